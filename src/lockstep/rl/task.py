"""lockstep.rl.task: arithmetic word problems with a numeric answer and an exact-match reward.

A problem is drawn from a template (who, what, one or two operations on small numbers) by a
random.Random, so a seed and a step number give the same problems on every run and every resume.
The reward is 1.0 when the last number of the completion is the answer and 0.0 otherwise: a person
can check every record of rollouts.jsonl by hand.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

NAMES = ("Tom", "Ann", "Sara", "Ben", "Mia", "Leo", "Eva", "Sam")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells")
INSTRUCTION = "Answer with the number only."
NUMBER = re.compile(r"-?\d[\d,]*")


@dataclass
class Problem:
    """One word problem: its text, the operands and operations it was built from, and the answer."""

    question: str
    answer: int
    operands: list[int]
    operations: list[str]            # "+", "-" or "*", applied left to right
    messages: list[dict] = field(default_factory=list)


def evaluate(operands: list[int], operations: list[str]) -> int:
    """The operations applied left to right (the order the story tells them in)."""
    value = operands[0]
    for op, x in zip(operations, operands[1:]):
        value = value + x if op == "+" else value - x if op == "-" else value * x
    return value


@dataclass
class ArithmeticTask:
    """Problems with `steps` operations on numbers up to `max_operand`; `multiply` allows "x" steps."""

    max_operand: int = 9
    steps: int = 1
    multiply: bool = False

    def __post_init__(self):
        if not isinstance(self.max_operand, int) or isinstance(self.max_operand, bool) or self.max_operand < 2:
            raise ValueError(f"max_operand: expected an int >= 2, got {self.max_operand!r}")
        if self.steps not in (1, 2):
            raise ValueError(f"steps: expected 1 or 2 operations per problem, got {self.steps!r}")

    def problems(self, count: int, rng: random.Random) -> list[Problem]:
        """`count` problems drawn from `rng`."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count: expected a positive int, got {count!r}")
        return [self._problem(rng) for _ in range(count)]

    def _problem(self, rng: random.Random) -> Problem:
        name, other = rng.sample(NAMES, 2)
        thing = rng.choice(THINGS)
        ops = ["+", "-"] + (["*"] if self.multiply else [])
        start = rng.randint(2, self.max_operand)
        operands, operations, sentences = [start], [], [f"{name} has {start} {thing}."]
        for _ in range(self.steps):
            op = rng.choice(ops)
            value = evaluate(operands, operations)
            x = rng.randint(1, self.max_operand if op != "-" else max(1, value))
            if op == "-" and value < 1:
                op = "+"
            operands.append(x)
            operations.append(op)
            sentences.append({"+": f"{other} gives {name} {x} more {thing}.",
                              "-": f"{name} gives {x} {thing} to {other}.",
                              "*": f"Then the number of {thing} {name} has grows {x} times."}[op])
        question = " ".join(sentences) + f" How many {thing} does {name} have now?"
        messages = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
        return Problem(question, evaluate(operands, operations), operands, operations, messages)

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion's last number is the answer, else 0.0."""
        return 1.0 if parse_answer(completion) == problem.answer else 0.0

    def to_record(self, problem: Problem, completion: str, reward: float) -> dict:
        """A JSON line a person can check: question, expected answer, completion, parsed answer, reward."""
        return {"question": problem.question, "answer": problem.answer, "completion": completion,
                "parsed": parse_answer(completion), "reward": reward}


def parse_answer(text: str) -> int | None:
    """The last integer in `text` ("The answer is 1,204." -> 1204); None when there is none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-").isdigit() else None
