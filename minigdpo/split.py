"""The split placement (--sampler-ranks N): the last N ranks of the torchrun job only sample, each with a whole copy of
the weights; the others only train, FSDP2 over themselves (docs/async.md tells the whole of it).

The sampling ranks run train.py's steps 1-3 and send each trainer its share of every step's groups, with every rank's
rewards; the trainers run steps 4-8, and after each update the first trainer broadcasts the weights to the sampling
ranks, one tensor at a time, without waiting (it keeps at most K + 1 updates' worth until they are sent). Keyed by
step as in minigdpo/pipeline.py, so with K = 0 the run is the synchronous one, sampled on other ranks.
"""

import time
from collections import deque

import torch

from minigdpo import dist
from minigdpo.pipeline import Pipeline


class SamplerLost(RuntimeError):
    """The other side stopped: a sampling rank (seen from a trainer), a trainer (seen from a sampling rank), or a
    sampling rank's own engine process (minigdpo/engine_process.py)."""


def pipeline(K, first, cursor, pending, last, sample, sampler, weights, overlap=False):
    """(this role's pipeline, the step the run starts from, the cursor there). The trainers tell the sampling ranks
    where that is (a resumed run's step, past the batches its checkpoint holds) and send them its weights."""
    first, cursor, sampled = _talk(dist.announce, (first, cursor, len(pending)), 0)  # the first trainer's
    if dist.role() == "trainer":
        pipe = Trainers(K, first, last, weights, pending)
    else:
        pipe = Samplers(K, first, first + 1 + sampled, last, sample, sampler.load_weights, overlap)
    pipe.begin()
    return pipe, first, cursor


class Remote:
    """What the trainers hold in the place of a sampler (train.py): their weights go to the sampling ranks from
    Trainers.begin and Trainers.publish, so nothing here loads, sleeps or closes."""

    def __init__(self, adapters_only):
        self.adapters_only = adapters_only

    def load_weights(self, weights=None):
        pass

    sleep = close = load_weights


def _talk(what, *args):
    """dist's channel call, its failure (the other side went) one line."""
    try:
        return what(*args)
    except RuntimeError as e:
        side = "a sampling rank" if dist.role() == "trainer" else "the trainers"
        raise SamplerLost(f"{side} stopped ({str(e).splitlines()[0][:200]}): this rank stops too") from None


class Trainers:
    """train.py's pipeline on a training rank, pipeline.Pipeline's interface: its batches come from the sampling
    ranks, its weights go to them. weights(): the model's (name, whole tensor) pairs (every trainer iterates them)."""

    def __init__(self, K, first, last, weights, pending=()):
        self.K, self.last, self.weights = K, last, weights
        self.ready = {first + 1 + i: entry for i, entry in enumerate(pending)}  # step -> (batch, cursor, version)
        self.sending = deque()  # [works] of the updates the samplers may not have yet

    def begin(self):
        """The weights the run starts from, to the sampling ranks: first what they are (names, shapes, dtypes)."""
        tensors = self._copies(self.weights())
        _talk(dist.announce, tensors and [(name, t.shape, t.dtype) for name, t in tensors], 0)
        self._send(tensors)

    def run(self, train):
        """Train every step, then meet the sampling ranks, which come once they hold the last weights: every
        broadcast is done by then."""
        train()
        _talk(dist.announce, None, 0)

    def batch(self, step):
        t0 = time.perf_counter()
        batch, cursor, version, waited = self.ready.pop(step) + (0.0,) if step in self.ready else self._receive(step)
        return batch, cursor, step - 1 - version, time.perf_counter() - t0, waited

    def publish(self, step, weights):
        """The update's weights (None: skipped) to the sampling ranks, without waiting for them."""
        tensors = self._copies(weights()) if weights is not None else None
        flag = torch.tensor([int(weights is not None)])
        self._send([("", flag)] + (tensors or []) if dist.rank() == 0 else None)

    def step_done(self, step):  # the sampling ranks wait for weights, not for the trainers' steps
        pass

    def pending(self, step):
        """The batches for steps step+1..step+K, received now (a checkpoint saves them)."""
        after = range(step + 1, min(step + self.K, self.last) + 1)
        self.ready |= {s: self._receive(s)[:3] for s in after if s not in self.ready}
        return [self.ready[s] for s in after]

    def _copies(self, weights):
        """The first trainer's copy of each whole tensor (the model moves on while it is sent); None elsewhere, where
        `weights` is iterated for its collectives alone."""
        copies = [(name, t.detach().clone()) for name, t in weights if dist.rank() == 0]
        return copies if dist.rank() == 0 else None

    def _send(self, tensors):
        if tensors is not None:
            self.sending.append([dist.bridge(t, wait=False) for _, t in tensors])  # [(tensor, work)]
        while len(self.sending) > self.K + 1:
            works = self.sending.popleft()
            _talk(lambda: [w.wait() for _, w in works])

    def _receive(self, step):
        """Step `step`'s batch: this trainer's groups from every sampling rank, in order, the rest from the first."""
        parts = [_talk(dist.recv_object, source) for source in dist.other_ranks()]
        batch, cursor, version, waited = parts[0]["batch"]
        batch.prompts = [p for part in parts for p in part["prompts"]]
        batch.completions = [c for part in parts for c in part["completions"]]
        return batch, cursor, version, waited


class Samplers(Pipeline):
    """train.py's pipeline on a sampling rank: Pipeline's sampling side as it is (generation overlapping the scoring
    where it may), with no trainer here: each batch goes to the trainers (_score), each update's weights come from them
    (_bring), loaded before the step that needs them."""

    def __init__(self, K, first, unsampled, last, sample, load, overlap):
        super().__init__(K, first, last, sample, load, overlap=overlap)
        self.unsampled, self.sent = unsampled, []  # sent: waits of the batches in flight

    def begin(self):
        """The weights the run starts from, after what they are (names, shapes, dtypes)."""
        self.manifest, self.loaded = _talk(dist.announce, None, 0), self.first - 1
        self._bring(self.first)

    def run(self, train=None):
        """Every step, sampled in order, sent to the trainers; returns holding the last update's weights."""
        self._sample_all()
        if self.error is not None:
            raise self.error
        self._bring(self.last)
        _talk(dist.announce, None, 0)  # the trainers come once they have trained every batch: all were sent

    def _score(self, step, score, cursor, version, waited):
        self._send(score(), (cursor, version, waited))

    def _bring(self, version):
        """Receive every update up to `version`, in order, loading each that changed the weights."""
        while self.loaded < version:
            self.loaded += 1
            if self.loaded == self.first or self._receive(torch.zeros(1, dtype=torch.long)).item():  # not skipped
                self.load((name, self._receive(torch.empty(shape, dtype=dtype))) for name, shape, dtype in
                          self.manifest)

    def _receive(self, tensor):
        return _talk(dist.bridge, tensor)[0]

    def _send(self, batch, rest):
        """Each trainer's share of the step's groups (S of them, rank j of N holding j * S // N on), with the rest of
        the batch from the first sampling rank."""
        S, N, T, j = len(batch.rewards), dist.world_size(), len(dist.other_ranks()), dist.rank()
        mine, prompts, completions = j * S // N, batch.prompts, batch.completions
        batch.prompts, batch.completions = [], []
        for i, trainer in enumerate(dist.other_ranks()):
            lo = max(i * S // T, mine) - mine  # trainer i's groups among this rank's: lo..hi
            hi = max(min((i + 1) * S // T, mine + len(prompts)) - mine, lo)
            part = {"prompts": prompts[lo:hi], "completions": completions[lo:hi]}
            part["batch"] = (batch, *rest) if j == 0 else None
            self.sent.append(dist.send_object(part, trainer))
        while len(self.sent) > (self.K + 2) * T:  # the oldest batches are in the trainers' hands by now
            _talk(self.sent.pop(0))
