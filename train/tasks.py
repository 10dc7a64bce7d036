"""Generated math tasks with verifiable integer answers, and the reward verifier.

Two task families, both seeded and deterministic:

* ``arithmetic``: a chain of 1-3 operations (+, -, *) on small integers, evaluated with the usual
  precedence, e.g. "Compute 3 + 4 * 2 - 5."
* ``word``: templated word problems ("Alice has 3 apples. She buys 5 more. ...").

Every example carries a worked target response that ends with the fixed answer format
``"The answer is N."`` (steps first, e.g. "4 * 2 = 8. 3 + 8 = 11. 11 - 5 = 6. The answer is 6.").
`reward` parses the final number of a completion and compares it with the answer.
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
from typing import Sequence

TASKS = ("arithmetic", "word")
SYSTEM_PROMPT = "Solve the math problem. End your reply with: The answer is <number>."
ANSWER_FORMAT = "The answer is {}."


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    task: str
    question: str
    response: str      # worked target answer, ends with ANSWER_FORMAT
    answer: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _steps_text(steps: Sequence[tuple[int, str, int, int]], answer: int) -> str:
    parts = [f"{a} {op} {b} = {c}." for a, op, b, c in steps]
    return " ".join(parts + [ANSWER_FORMAT.format(answer)])


# ------------------------------------------------------------------------------------ arithmetic
def arithmetic_example(rng: random.Random, idx: int = 0, max_ops: int = 3) -> Example:
    """An expression of 1..max_ops operations; '*' operands are 1..9, '+'/'-' operands 1..20."""
    n_ops = rng.randint(1, max_ops)
    ops = [rng.choice("+-*") for _ in range(n_ops)]
    nums = [rng.randint(1, 20)]
    for op in ops:
        if op == "*":
            nums[-1] = rng.randint(1, 9) if nums[-1] > 9 else nums[-1]
            nums.append(rng.randint(1, 9))
        else:
            nums.append(rng.randint(1, 20))
    question = "Compute " + " ".join(str(nums[0]) if i == 0 else f"{ops[i - 1]} {nums[i]}"
                                     for i in range(len(nums))) + "."
    # evaluate with precedence, recording one step per operation: all '*' first, then left to right
    vals, rest_ops, steps = list(nums), list(ops), []
    i = 0
    while i < len(rest_ops):
        if rest_ops[i] == "*":
            c = vals[i] * vals[i + 1]
            steps.append((vals[i], "*", vals[i + 1], c))
            vals[i:i + 2] = [c]
            rest_ops.pop(i)
        else:
            i += 1
    acc = vals[0]
    for op, v in zip(rest_ops, vals[1:]):
        c = _apply(acc, op, v)
        steps.append((acc, op, v, c))
        acc = c
    expected = eval(" ".join(str(nums[0]) if i == 0 else f"{ops[i - 1]} {nums[i]}" for i in range(len(nums))))
    assert acc == expected, (question, acc, expected)
    return Example(f"arithmetic-{idx}", "arithmetic", question, _steps_text(steps, acc), acc)


# ------------------------------------------------------------------------------------------ word
NAMES = ("Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam")
ITEMS = ("apples", "books", "marbles", "pencils", "stickers", "cookies", "coins", "shells", "cards", "stamps")
PRONOUN = {"Alice": "She", "Carla": "She", "Emma": "She", "Grace": "She", "Ines": "She", "Kira": "She"}


def word_example(rng: random.Random, idx: int = 0) -> Example:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    he = PRONOUN.get(name, "He")
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        q = f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {name} have now?"
        steps = [(a, "+", b, a + b)]
    elif kind == 1:
        a = rng.randint(2, 30)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?"
        steps = [(a, "-", b, a - b)]
    elif kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} have?"
        steps = [(a, "*", b, a * b)]
    elif kind == 3:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        c = rng.randint(1, a + b - 1) if a + b > 1 else 0
        q = (f"{name} has {a} {item}. {he} buys {b} more, then gives {c} to {other}. "
             f"How many {item} does {name} have now?")
        steps = [(a, "+", b, a + b), (a + b, "-", c, a + b - c)]
    else:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        q = (f"{name} has {a} bags with {b} {item} in each bag and {c} loose {item}. "
             f"How many {item} does {name} have in total?")
        steps = [(a, "*", b, a * b), (a * b, "+", c, a * b + c)]
    answer = steps[-1][3]
    return Example(f"word-{idx}", "word", q, _steps_text(steps, answer), answer)


def generate_examples(n: int, seed: int, tasks: Sequence[str] = TASKS, max_ops: int = 3) -> list[Example]:
    """`n` examples, deterministic in (n, seed, tasks); task families alternate round-robin."""
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tuple(tasks)}")
    if isinstance(max_ops, bool) or not isinstance(max_ops, int) or max_ops < 1:
        raise ValueError(f"max_ops (--max-ops) must be an integer >= 1, got {max_ops!r}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        out.append(arithmetic_example(rng, i, max_ops) if task == "arithmetic" else word_example(rng, i))
    return out


# ---------------------------------------------------------------------------------------- reward
_ANSWER_RE = re.compile(r"answer is\s*:?\s*\$?(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_int(s: str) -> int | float | None:
    s = s.replace(",", "").rstrip(".")
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return None


def extract_answer(text: str) -> int | float | None:
    """The final number of a completion: the last "answer is N" if present, else the last number."""
    found = _ANSWER_RE.findall(text)
    if found:
        return _to_int(found[-1])
    nums = _NUMBER_RE.findall(text)
    return _to_int(nums[-1]) if nums else None


def answer_number(answer) -> int | float | None:
    """A dataset's answer as the number `reward` compares with: an int or float, or a string of one
    ("42", " 1,234 ", "-3.5", "7."), else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return answer if math.isfinite(answer) else None
    return _to_int(answer.strip()) if isinstance(answer, str) and _NUMBER_RE.fullmatch(answer.strip().rstrip(".")) \
        else None


def reward(completion_text: str, answer) -> float:
    """1.0 when the completion's final number equals `answer` (a number or a string of one), else 0.0.
    ValueError for an answer that is no number (train.grpo checks a dataset's answers up front)."""
    want = answer_number(answer)
    if want is None:
        raise ValueError(f"the answer reward compares numbers; answer {answer!r} is not one")
    got = extract_answer(completion_text)
    return 1.0 if got is not None and got == want else 0.0
