"""Asynchronous rollouts (--async-steps K): the next batches are sampled and scored while this one trains
(docs/async.md tells the whole of it).

The main thread samples (train.py's steps 1-3; SIGALRM time limits work there only), the trainer (steps 4-8) takes
the batches in a thread of its own, in order, each exactly once; with K = 0 one thread does both, in turn, and with
`overlap` a third generates step s + 1 while step s is scored (docs/async.md, "What runs where"). Keyed by step: step
s is sampled by the weights of update max(first, s - 1 - K) (first: where the run started) and by its own seed, never
by thread timing (docs/async.md, "Keyed by step"); publish, step_done and pending say when weights and batches move.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor


class Stopped(RuntimeError):
    """The other side of the pipeline failed: this side stops too (the other's error is the one raised)."""


class Pipeline:
    """The batches between the sampler (the main thread) and the trainer (run's thread); see the module docstring.

    sample(step, version) -> (score, cursor): steps 1-2 of `step` (version: the updates its weights had); score() -> the
    batch: step 3, on the main thread. load(weights): put published weights, (name, tensor) pairs, into the sampler."""

    def __init__(self, K, first, last, sample, load, pending=(), overlap=False):
        self.K, self.first, self.last, self.overlap = K, first, last, overlap and K > 0
        self.sample, self.load = sample, load
        self.ready = {first + 1 + i: (*entry, 0.0) for i, entry in enumerate(pending)}  # a checkpoint's batches first
        self.unsampled = first + 1 + len(pending)  # the first step to sample
        self.version = first        # the steps the trainer finished (step_done): their weights may sample
        self.loaded = first         # the updates whose weights the sampler holds
        self.snapshots = {}         # version -> weights published for the sampler (None: the update was skipped)
        self.error = None
        self.cond = threading.Condition()

    # The trainer's side ------------------------------------------------------------------------------------------

    def batch(self, step):
        """(the batch of `step`, its cursor, staleness, seconds the trainer waited, seconds the sampler waited). With
        K = 0 the step is sampled here and now, on the one thread that runs both sides."""
        t0 = time.perf_counter()
        if self.K == 0 and step not in self.ready:
            self._score(step, *self._generate(step))
        with self.cond:
            self._wait(lambda: step in self.ready)
            batch, cursor, version, waited = self.ready.pop(step)
        return batch, cursor, step - 1 - version, time.perf_counter() - t0, waited

    def publish(self, step, weights):
        """Update `step` is done: its weights (a callable giving (name, tensor) pairs; None where the step skipped its
        update) go to the sampler: at once with K = 0, where it waits for them, as a synchronous run syncs; with
        K >= 1 as a copy it loads before the step that needs it (at most K + 1 copies wait)."""
        if self.K == 0:  # one thread does both sides: nothing to lock
            if weights is not None:
                self.load(weights())
            self.loaded = step
            return
        copy = None if weights is None else [(name, t.detach().clone()) for name, t in weights()]
        with self.cond:
            self.snapshots[step] = copy

    def step_done(self, step):
        """The trainer's step is over, its last collective (metrics, checkpoint) included: the sampler may now sample
        with that step's weights. Not before: with K = 0 the two sides share the world group, and a collective of the
        next step's sampling must not come between the trainer's on one rank and not on another."""
        with self.cond:
            self.version = step
            self.cond.notify_all()

    def pending(self, step):
        """What a checkpoint at `step` saves: [(batch, cursor, version)] for steps step+1..step+K, each waited for
        where it is being sampled (it needs no weights newer than the trainer's)."""
        upto = min(step + self.K, self.last)
        with self.cond:
            self._wait(lambda: all(s in self.ready for s in range(step + 1, upto + 1)))
            return [self.ready[s][:3] for s in range(step + 1, upto + 1)]

    # The sampler's side ------------------------------------------------------------------------------------------

    def run(self, train):
        """Sample every step not yet sampled, in order, on this (the main) thread, while train() runs the trainer's
        loop in another; returns once both are done, the sampler holding the last weights. Either side's error stops
        the other and is raised here. With K = 0 there is no other thread: train() runs here and samples each step
        when it asks for it (`batch`), as a synchronous loop does, its compute on one thread."""
        if self.K == 0:
            train()
            return
        trainer = threading.Thread(target=self._guard, args=(train,), name="minigdpo-trainer", daemon=True)
        trainer.start()
        self._sample_all()
        trainer.join(timeout=None if self.error is None else 60)  # a trainer deep in an update is not waited for long
        if self.error is not None:
            raise self.error
        self._bring(self.version)

    def _sample_all(self):
        """Every step not yet sampled, in order, scored here (overlap: the next generating meanwhile); errors: _fail."""
        with ThreadPoolExecutor(1, thread_name_prefix="minigdpo-generate") as pool:
            try:
                ahead, steps = None, range(self.unsampled, self.last + 1)
                for step in steps:
                    generated = ahead.result() if ahead else self._generate(step)
                    ahead = pool.submit(self._generate, step + 1) if self.overlap and step + 1 in steps else None
                    self._score(step, *generated)
            except BaseException as e:  # a Ctrl-C too: the trainer stops at its next wait, generation at its next
                self._fail(e)

    def _generate(self, step):
        """Steps 1-2 of `step`, once the weights its step names are in the sampler: (score, cursor, version, wait)."""
        t0 = time.perf_counter()
        version = max(self.first, step - 1 - self.K)  # the updates whose weights sample `step`
        self._bring(version)
        waited = time.perf_counter() - t0
        return *self.sample(step, version), version, waited

    def _score(self, step, score, cursor, version, waited):
        """Step 3 of `step`, on the main thread; then its batch is the trainer's."""
        batch = score()
        with self.cond:
            self.ready[step] = (batch, cursor, version, waited)
            self.cond.notify_all()

    def _bring(self, version):
        """Wait until the trainer finished step `version`, then load the newest weights up to it where the sampler
        holds older ones (with K = 0 the trainer loaded them already)."""
        with self.cond:
            self._wait(lambda: self.version >= version)
            newer = sorted(v for v in self.snapshots if self.loaded < v <= version)
            weights = next((self.snapshots[v] for v in reversed(newer) if self.snapshots[v] is not None), None)
            for v in [v for v in self.snapshots if v <= version]:
                del self.snapshots[v]
        if weights is not None:
            self.load(weights)
        self.loaded = max(self.loaded, version)

    # Both ------------------------------------------------------------------------------------------------------

    def _guard(self, train):
        try:
            train()
        except BaseException as e:
            self._fail(e)

    def _fail(self, error):
        with self.cond:
            if self.error is None and not isinstance(error, Stopped):
                self.error = error
            self.cond.notify_all()

    def _wait(self, condition):
        """Wait (holding self.cond) until condition(), or raise Stopped where the other side failed."""
        while not condition():
            if self.error is not None:
                raise Stopped("the other side of the pipeline failed")
            self.cond.wait(timeout=1.0)
