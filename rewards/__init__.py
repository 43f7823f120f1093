"""Built-in rewards, one file per task. Importing this package registers them all.

| file        | rewards                          | task              |
|-------------|----------------------------------|-------------------|
| gsm8k.py    | format, correct, integer         | gsm8k, arith      |
| length.py   | length_ok                        | any (with --condition) |
| toolcall.py | tool_format, tool_correct        | toolcall          |
| math_length.py | (answer checking for correct) | math_length       |
| code.py     | pass, no_bug                     | code              |
"""

from rewards import code, gsm8k, length, math_length, toolcall  # noqa: F401  (registration side effects)
