"""lockstep.rl.task: arithmetic word problems with a numeric answer and an exact-match reward.

A problem is a short story (a name, a kind of object, one or two steps of +, - or x on small
numbers) drawn by a random.Random, so a seed and a step number give the same problems on every run
and every resume. The reward is 1.0 when the last number of the completion is the answer and 0.0
otherwise, so a person can check every record of rollouts.jsonl by hand; `check_problem` reads a
problem's story back on its own and recomputes its answer.
"""

from __future__ import annotations

import operator
import random
import re
from dataclasses import dataclass, field

from .. import checks

NAMES = ("Tom", "Ann", "Sara", "Ben", "Mia", "Leo", "Eva", "Sam", "Lily", "Max", "Zoe", "Jack")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells", "cookies", "stamps")
# The default prompt: the best of the variants measured on SmolLM2-135M-Instruct (ArithmeticTask).
SYSTEM = None
INSTRUCTION = "Answer with the number only."

# The story's sentences. Each step's templates say its operation in words that `read_question`
# recognizes without the table: "more" adds, "gives ... to", "loses" and "sells" take away, and
# "in each" / "Each" multiplies (only as the first step: a count of groups, then the group's size).
OPENINGS = ("{name} has {a} {thing}.", "There are {a} {thing} in {name}'s bag.")
GROUPS = ("{name} has {a} boxes with {b} {thing} in each box.",
          "{name} buys {a} packs of {thing}. Each pack holds {b} {thing}.")
STEPS = {
    "+": ("{other} gives {name} {x} more {thing}.", "{name} buys {x} more {thing}.",
          "{name} finds {x} more {thing}."),
    "-": ("{name} gives {x} {thing} to {other}.", "{name} loses {x} {thing}.", "{name} sells {x} {thing}."),
}
QUESTIONS = ("How many {thing} does {name} have now?", "How many {thing} does {name} have in the end?")


@dataclass
class Problem:
    """One word problem: its text, the numbers and operations it was built from, and the answer.

    operands and operations reproduce the answer (`evaluate`: left to right, the order the story
    tells them in); name, other, thing and templates (the index of each sentence's template:
    opening, then one per step, then the question) reproduce the text."""

    question: str
    answer: int
    operands: list[int]
    operations: list[str]            # "+", "-" or "*", applied left to right
    messages: list[dict] = field(default_factory=list)
    name: str = ""
    other: str = ""
    thing: str = ""
    templates: list[int] = field(default_factory=list)


def evaluate(operands: list[int], operations: list[str]) -> int:
    """The operations applied left to right (the order the story tells them in)."""
    value = operands[0]
    for op, x in zip(operations, operands[1:]):
        value = value + x if op == "+" else value - x if op == "-" else value * x
    return value


@dataclass
class ArithmeticTask:
    """Word problems of `steps` operations (1 or 2) on numbers from 1 to `max_operand`; `multiply`
    lets the first step be a product (groups x size, each factor at most min(max_operand, 9)).
    Subtraction never goes below zero, so every answer is an int >= 0.

    `system` (a system message, or None for the model's own) and `instruction` (appended to the
    question) make the chat prompt. The defaults were the best of the variants measured on
    SmolLM2-135M-Instruct (bf16, 24 problems x 4 completions at T = 1, 24 new tokens, stop at end
    of sequence): mean reward 0.10 and a success in 38% of the groups, against 0.06 with the
    system message "You are a helpful assistant.", 0.08 with "Give only the final number." and
    0.05 with "Think briefly, then end with: The answer is N."; 40 new tokens gave 0.06. A reward
    near 0.1 leaves most groups of 8 with both outcomes, which is what GRPO learns from."""

    max_operand: int = 9
    steps: int = 1
    multiply: bool = False
    system: str | None = SYSTEM
    instruction: str = INSTRUCTION

    def __post_init__(self):
        checks.int_at_least("max_operand", self.max_operand, 2)
        if self.steps not in (1, 2) or isinstance(self.steps, bool):
            raise ValueError(f"steps: expected 1 or 2 operations per problem, got {self.steps!r}")
        if not isinstance(self.multiply, bool):
            raise ValueError(f"multiply: expected True or False, got {self.multiply!r}")
        if self.system is not None and not isinstance(self.system, str):
            raise ValueError(f"system: expected a string or None, got {self.system!r}")
        if not isinstance(self.instruction, str):
            raise ValueError(f"instruction: expected a string, got {self.instruction!r}")

    def problems(self, count: int, rng: random.Random) -> list[Problem]:
        """`count` problems drawn from `rng` (the same rng state gives the same problems)."""
        checks.int_at_least("count", count)
        if not isinstance(rng, random.Random):
            raise ValueError(f"rng: expected a random.Random, got {type(rng).__name__}")
        return [self._problem(rng) for _ in range(count)]

    def _problem(self, rng: random.Random) -> Problem:
        name, other = rng.sample(NAMES, 2)
        thing = rng.choice(THINGS)
        templates, sentences = [], []
        if self.multiply and rng.random() < 0.5:
            factor = min(self.max_operand, 9)
            operands, operations = [rng.randint(2, factor), rng.randint(2, factor)], ["*"]
            templates.append(rng.randrange(len(GROUPS)))
            sentences.append(GROUPS[templates[-1]].format(name=name, a=operands[0], b=operands[1], thing=thing))
        else:
            operands, operations = [rng.randint(2, self.max_operand)], []
            templates.append(rng.randrange(len(OPENINGS)))
            sentences.append(OPENINGS[templates[-1]].format(name=name, a=operands[0], thing=thing))
        while len(operations) < self.steps:
            value = evaluate(operands, operations)
            op = rng.choice(("+", "-")) if value > 1 else "+"
            x = rng.randint(1, self.max_operand if op == "+" else min(self.max_operand, value))
            operands.append(x)
            operations.append(op)
            templates.append(rng.randrange(len(STEPS[op])))
            sentences.append(STEPS[op][templates[-1]].format(name=name, other=other, x=x, thing=thing))
        templates.append(rng.randrange(len(QUESTIONS)))
        question = " ".join(sentences + [QUESTIONS[templates[-1]].format(name=name, thing=thing)])
        return Problem(question, evaluate(operands, operations), operands, operations, self.messages(question),
                       name, other, thing, templates)

    def messages(self, question: str) -> list[dict]:
        """The chat messages of a question: the system message (when set), then the question and
        the instruction as the user's turn."""
        user = {"role": "user", "content": f"{question} {self.instruction}".strip()}
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + [user]

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the completion's last number (`parse_answer`) is the answer, else 0.0."""
        return 1.0 if parse_answer(completion) == problem.answer else 0.0

    def to_record(self, problem: Problem, completion: str, reward: float) -> dict:
        """A JSON line a person can check: question, expected answer, completion, parsed answer, reward."""
        return {"question": problem.question, "answer": problem.answer, "completion": completion,
                "parsed": parse_answer(completion), "reward": reward}


# A number: digits with or without thousands separators ("1,204"), and a decimal part, which must be
# zeros for the number to be a whole one ("7.0"). A minus sign right before it counts unless it is a
# hyphen after a letter or digit ("10-3" is 10 and 3; "-3" and "is -3" are -3).
NUMBER = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.(\d+))?")
MINUS = ("-", "\u2212")


def parse_answer(text: str) -> int | None:
    """The last number in `text`, as an int ("The answer is 1,204." -> 1204, "**7** apples" -> 7,
    "-3" -> -3); None when there is none or the last one is not a whole number ("7.5")."""
    if not isinstance(text, str):
        return None
    last = None
    for last in NUMBER.finditer(text):
        pass
    if last is None or (last.group(2) or "").strip("0"):
        return None
    value = int(last.group(1).replace(",", ""))
    start = last.start()
    signed = start > 0 and text[start - 1] in MINUS and (start < 2 or not text[start - 2].isalnum())
    return -value if signed else value


_READ = [("*", re.compile(r"\bin each\b|\bEach\b")), ("+", re.compile(r"\bmore\b")),
         ("-", re.compile(r"\bgives\b.*\bto\b|\bloses\b|\bsells\b"))]
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def read_question(question: str) -> tuple[list[int], list[str]]:
    """The numbers and operations a question's words say, read from its text alone (not from the
    templates): the numbers in order, and for each sentence after the first number the operation its
    wording names."""
    operands, operations = [], []
    for sentence in re.findall(r"[^.?]+[.?]", question):
        numbers = [int(n) for n in re.findall(r"\d+", sentence)]
        if not numbers:
            continue
        for number in numbers:
            if operands:
                said = [op for op, words in _READ if words.search(sentence)]
                operations.append(said[0] if len(said) == 1 else "?")
            operands.append(number)
    return operands, operations


def check_problem(problem: Problem, task: ArithmeticTask | None = None) -> list[str]:
    """What is wrong with a problem, found without the code that made it: its story read back
    (`read_question`) must give its operands and operations, its answer must be their value computed
    anew (Python's operator module, left to right) and >= 0, and with `task` its numbers must be in
    the task's range and its messages the task's. An empty list: nothing is wrong."""
    errors = []
    operands, operations = read_question(problem.question)
    if (operands, operations) != (problem.operands, problem.operations):
        errors.append(f"the question says {operands} {operations}, the problem stores "
                      f"{problem.operands} {problem.operations}")
    value = problem.operands[0] if problem.operands else None
    for op, x in zip(problem.operations, problem.operands[1:]):
        value = _OPS[op](value, x) if op in _OPS else None
        if value is None:
            break
    if value != problem.answer:
        errors.append(f"answer {problem.answer}, but {problem.operands} {problem.operations} make {value}")
    if not isinstance(problem.answer, int) or problem.answer < 0:
        errors.append(f"answer {problem.answer!r}: expected an int >= 0")
    if task is not None:
        if len(problem.operations) != task.steps:
            errors.append(f"{len(problem.operations)} operations, the task has steps={task.steps}")
        if any(not 1 <= x <= task.max_operand for x in problem.operands):
            errors.append(f"operands {problem.operands}: expected each in [1, {task.max_operand}]")
        if problem.messages != task.messages(problem.question):
            errors.append("messages: not the task's prompt for this question")
    return errors
