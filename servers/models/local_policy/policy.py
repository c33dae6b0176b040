"""The decisions of the embedded policy.

A small program that plays a model: it calls a tool the prompt is about with
arguments read from the prompt, answers from tool outputs once they arrive,
works out arithmetic, and guesses at multiple-choice questions (it cannot
know their answers, so it takes the longest option, a test-taker's hunch),
and in a game whose board lists the available moves (TextArena's), plays
one of them, each as likely as the others.
A tool call, a sum and a guess each rest on one random decision, whether to
slip (mangle an argument, get a sum wrong, pick another option), whose
chance grows with the work involved. The decision is sampled the way an
engine samples a token: `temperature` sharpens or flattens the distribution
(0 is greedy and never slips), `top_p` cuts the unlikely branch.
"""

from __future__ import annotations

import json
import math
import operator
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gym_grpc.data import json_input
from gym_grpc.data.rows import tool_parameters
from gym_grpc.responses import TOOL_ERROR_PREFIX, message_text
from gym_grpc.v1 import responses_pb2 as r


@dataclass
class Turn:
    """What the policy says in one turn."""

    text: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    reasoning: str = ""
    #: Log-probability of the sampled decision, and the text it decided.
    logprob: float = 0.0
    decided: str = ""


def sample_slip(rng: random.Random, p_slip: float, temperature: float, top_p: float) -> tuple[bool, float]:
    """Sample "slip or not"; return the choice and its log-probability."""
    if p_slip <= 0.0 or temperature <= 0.0:
        return False, 0.0
    weights = [(1.0 - p_slip) ** (1.0 / temperature), p_slip ** (1.0 / temperature)]
    probs = [w / sum(weights) for w in weights]
    if probs[0] >= top_p:  # nucleus sampling keeps only the likely branch
        return False, 0.0
    slipped = rng.random() < probs[1]
    return slipped, math.log(probs[1] if slipped else probs[0])


# --- arithmetic --------------------------------------------------------------

_WORDS = [
    (r"\bmultiplied by\b", "*"),
    (r"\btimes\b", "*"),
    (r"\bdivided by\b", "/"),
    (r"\bplus\b", "+"),
    (r"\bminus\b", "-"),
    ("×", "*"),
    ("÷", "/"),
]
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

#: The tokens of an arithmetic expression: a number, an operator or a parenthesis, or whitespace (the
#: `space` group); any other character is not arithmetic.
_TOKEN = re.compile(r"(?P<space>[ \t\f\r\n]+)|(?P<number>[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)|(?P<op>\*\*|//|[-+*/()])")

#: Parentheses nested deeper than this are not arithmetic (nor Python: "too many nested parentheses").
_MAX_NESTING = 200


def _tokens(text: str) -> list[str]:
    """The tokens of `text` as Python reads them; ValueError where Python would find a syntax error.

    A line break only inside parentheses, as in Python; an integer with leading zeros is refused, as
    Python refuses it (a float may have them)."""
    tokens: list[str] = []
    depth, at = 0, 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise ValueError("not arithmetic")
        at = match.end()
        token = match.group()
        if match.lastgroup == "space":
            if depth == 0 and ("\n" in token or "\r" in token):
                raise ValueError("a line break outside parentheses")
            continue
        if match.lastgroup == "number" and "." not in token and token[0] == "0" and token.strip("0"):
            raise ValueError("leading zeros")
        depth += token == "("
        depth -= token == ")"
        if depth < 0 or depth > _MAX_NESTING:
            raise ValueError("parentheses unbalanced, or nested too deep")
        tokens.append(token)
    return tokens


def _evaluate(text: str) -> tuple[Fraction, int]:
    """Value of an arithmetic expression (numbers, + - * /, unary signs, parentheses) and its number
    of operations, read as Python reads it; ValueError for anything else (`**`, `//`, a call such as
    `2(3)`), ZeroDivisionError for a division by zero.

    Not `ast.parse`: on Python 3.11 the AST constructor's recursion count is shared by every thread,
    and an AST built in another thread at the same time (a traceback formatted, since 3.11 marks its
    carets with `ast.parse`) makes it raise SystemError."""
    tokens = _tokens(text)
    at = 0
    by_zero = False  # raised once the whole text is read: a syntax error counts first, as in Python

    def peek() -> str:
        return tokens[at] if at < len(tokens) else ""

    def expression() -> tuple[Fraction, int]:
        nonlocal at
        value, ops = term()
        while peek() in ("+", "-"):
            op = tokens[at]
            at += 1
            right, right_ops = term()
            value, ops = _OPS[op](value, right), ops + right_ops + 1
        return value, ops

    def term() -> tuple[Fraction, int]:
        nonlocal at, by_zero
        value, ops = factor()
        while peek() in ("*", "/"):
            op = tokens[at]
            at += 1
            right, right_ops = factor()
            if op == "/" and not right:
                by_zero, right = True, Fraction(1)
            value, ops = _OPS[op](value, right), ops + right_ops + 1
        return value, ops

    def factor() -> tuple[Fraction, int]:
        nonlocal at
        negative = False
        while peek() in ("+", "-"):
            negative ^= tokens[at] == "-"
            at += 1
        token = peek()
        at += 1
        if token == "(":
            value, ops = expression()
            if peek() != ")":
                raise ValueError("not arithmetic")  # `()`, or an unclosed parenthesis
            at += 1
        elif token[:1].isdigit() or token[:1] == ".":
            value, ops = Fraction(str(float(token) if "." in token else int(token))), 0
        else:
            raise ValueError("not arithmetic")
        if peek() in ("(", "**"):  # a call, a power
            raise ValueError("not arithmetic")
        return (-value if negative else value), ops

    result = expression()
    if at != len(tokens):
        raise ValueError("not arithmetic")
    if by_zero:
        raise ZeroDivisionError("division by zero")
    return result


def find_arithmetic(prompt: str) -> tuple[str, Fraction, int] | None:
    """The longest arithmetic expression in a prompt: (text, value, operations)."""
    text = prompt
    for pattern, op in _WORDS:
        text = re.sub(pattern, op, text, flags=re.I)
    best = None
    for match in re.finditer(r"[\d(][\d\s+\-*/().]*", text):
        candidate = match.group().strip().rstrip(".").strip()
        if not re.search(r"\d\s*[-+*/]\s*[\d(-]", candidate):
            continue
        try:
            value, ops = _evaluate(candidate)
        except (ValueError, ZeroDivisionError):
            continue
        if best is None or len(candidate) > len(best[0]):
            best = (candidate, value, ops)
    return best


def latex(value: Fraction) -> str:
    """A number as LaTeX: 42, or \\frac{7}{8}, or -\\frac{1}{2}."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


# --- multiple choice ---------------------------------------------------------

#: An option's marker at the start of a line or after white space: "(C) ", "A) " or "B. ".
_OPTION = re.compile(r"(?:^|(?<=\s))(?:\(([A-J])\)|([A-J])[.)])[ \t]+(?=\S)", re.M)


def find_options(prompt: str) -> list[tuple[str, str]]:
    """The lettered options a prompt lists, as (letter, text): the longest run
    A, B, C, ... of option markers, if it has two or more. An option's text runs
    to the next marker or the end of its line."""
    runs: list[list[re.Match[str]]] = []
    for match in _OPTION.finditer(prompt):
        letter = match.group(1) or match.group(2)
        if letter == "A":
            runs.append([match])
        elif runs and ord(letter) == ord("A") + len(runs[-1]):
            runs[-1].append(match)
    best = max(runs, key=len, default=[])
    if len(best) < 2:
        return []
    options = []
    for i, match in enumerate(best):
        end = best[i + 1].start() if i + 1 < len(best) else len(prompt)
        text = prompt[match.end() : end].split("\n", 1)[0].strip()
        options.append((match.group(1) or match.group(2), text))
    return options


def choose_option(
    options: list[tuple[str, str]], rng: random.Random, error_rate: float, temperature: float, top_p: float
) -> tuple[str, float]:
    """The letter the policy guesses, and its log-probability: the longest option
    (the first of the longest), or after a slip any other option, all equally likely."""
    hunch = max(range(len(options)), key=lambda i: (len(options[i][1]), -i))
    slipped, logprob = sample_slip(rng, error_rate, temperature, top_p)
    if not slipped:
        return options[hunch][0], logprob
    others = [letter for i, (letter, _) in enumerate(options) if i != hunch]
    return rng.choice(others), logprob - math.log(len(others))


# --- games -------------------------------------------------------------------

#: The legal moves a TextArena board lists: "Available Moves: '[0]', '[3]', '[8]'".
_MOVES = re.compile(r"Available Moves:((?:\s*'\[[^\]']{1,20}\]',?)+)")


def find_moves(prompt: str) -> list[str]:
    """The moves the last board of a prompt lists as available ("[4]"), in order; [] without one."""
    boards = _MOVES.findall(prompt)
    return re.findall(r"'(\[[^\]']{1,20}\])'", boards[-1]) if boards else []


# --- tools -------------------------------------------------------------------

_STOP_WORDS = {"what", "with", "this", "that", "from", "your", "have", "when", "please", "tell", "right", "like"}


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in _STOP_WORDS}


def pick_tool(prompt: str, tools: list[r.FunctionTool], choice: r.ToolChoice) -> r.FunctionTool | None:
    """The tool a prompt is about, honouring tool_choice."""
    kind = choice.WhichOneof("choice")
    if kind == "function_name":
        return next((t for t in tools if t.name == choice.function_name), None)
    if not tools or choice.mode == r.TOOL_CHOICE_MODE_NONE:
        return None
    words = _words(prompt)
    scored = [(len(words & _words(f"{t.name.replace('_', ' ')} {t.description}")), i) for i, t in enumerate(tools)]
    score, index = max(scored, key=lambda s: (s[0], -s[1]))
    if score == 0 and choice.mode != r.TOOL_CHOICE_MODE_REQUIRED:
        return None
    return tools[index]


def _phrase(prompt: str) -> str:
    """The proper noun a prompt is about: after in/for/at/of, else any, else the last word."""
    name = r"[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*"
    match = re.search(rf"\b(?:in|for|at|of|about)\s+({name})", prompt)
    if match:
        return match.group(1)
    names = re.findall(rf"(?<!^)(?<![.?!]\s)\b({name})", prompt)
    if names:
        return names[0]
    quoted = re.search(r"['\"]([^'\"]+)['\"]", prompt)
    if quoted:
        return quoted.group(1)
    words = re.findall(r"[\w'-]+", prompt)
    return words[-1] if words else ""


def arguments_for(tool: r.FunctionTool, prompt: str) -> dict[str, Any]:
    """Arguments for a tool's required parameters, read from the prompt."""
    schema = tool_parameters(tool) or {}
    props = schema.get("properties", {})
    args: dict[str, Any] = {}
    for name in schema.get("required", list(props)):
        prop = props.get(name, {})
        kind = prop.get("type")
        if "enum" in prop:
            mentioned = [v for v in prop["enum"] if str(v).lower() in prompt.lower()]
            args[name] = mentioned[0] if mentioned else prop["enum"][0]
        elif kind == "string":
            args[name] = _phrase(prompt)
        elif kind in ("integer", "number"):
            number = re.search(r"-?\d+(?:\.\d+)?", prompt)
            value = float(number.group()) if number else 0
            args[name] = int(value) if kind == "integer" else value
        elif kind == "boolean":
            args[name] = False
        elif kind == "array":
            args[name] = []
        elif kind == "object":
            args[name] = {}
    return args


def _mangle(args: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The arguments with one slip in the first value; return it and the slipped text."""
    bad = dict(args)
    for key, value in args.items():
        if isinstance(value, str) and value:
            bad[key] = value.lower()[:-1] if len(value) > 2 else value + "x"
            return bad, bad[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            bad[key] = value + 1
            return bad, str(bad[key])
    return bad, ""


def _summarise(output: str) -> str:
    try:
        data = json_input.loads(output)
    except ValueError:
        return output
    if isinstance(data, dict):
        return ", ".join(f"{k}: {v}" for k, v in data.items())
    return output


# --- the policy --------------------------------------------------------------


def _trailing_outputs(items: list[r.Item]) -> list[tuple[str, str]]:
    """(tool name, output) of the tool outputs that end the conversation."""
    names = {i.function_call.call_id: i.function_call.name for i in items if i.WhichOneof("item") == "function_call"}
    outputs = []
    for item in reversed(items):
        if item.WhichOneof("item") != "function_call_output":
            break
        out = item.function_call_output
        outputs.append((names.get(out.call_id, "the tool"), out.output))
    return outputs[::-1]


def _last_user_text(items: list[r.Item]) -> str:
    for item in reversed(items):
        if item.WhichOneof("item") == "message" and item.message.role == r.ROLE_USER:
            return message_text(item.message)
    return ""


def decide(
    items: list[r.Item],
    params: r.CreateParams,
    rng: random.Random,
    error_rate: float,
    temperature: float,
    top_p: float,
) -> Turn:
    """The policy's next turn for a conversation."""
    think = bool(params.reasoning.effort)
    outputs = _trailing_outputs(items)
    if outputs:
        answers = []
        for name, output in outputs:
            if output.startswith(TOOL_ERROR_PREFIX):
                answers.append(f"I could not get an answer from {name}. {output}")
            else:
                answers.append(f"According to {name}: {_summarise(output)}.")
        reasoning = "I have the tool results; I will report them." if think else ""
        return Turn(text=" ".join(answers), reasoning=reasoning)

    prompt = _last_user_text(items)
    tools = [t.function for t in params.tools if t.WhichOneof("tool") == "function"]
    chosen = pick_tool(prompt, tools, params.tool_choice)
    if chosen is not None:
        args = arguments_for(chosen, prompt)
        slipped, logprob = sample_slip(rng, error_rate, temperature, top_p)
        decided = next((str(v) for v in args.values()), "")
        if slipped:
            args, decided = _mangle(args)
        reasoning = f"The user asks something {chosen.name} can answer; I will call it." if think else ""
        return Turn(calls=[(chosen.name, json.dumps(args))], reasoning=reasoning, logprob=logprob, decided=decided)

    moves = find_moves(prompt)
    if moves:  # a game's turn: any legal move, all equally likely
        move = rng.choice(moves)
        reasoning = "It is my move; any of the available ones will do." if think else ""
        return Turn(text=move, reasoning=reasoning, logprob=-math.log(len(moves)), decided=move)

    options = find_options(prompt)
    if options:
        letter, logprob = choose_option(options, rng, error_rate, temperature, top_p)
        # No capital A-J before the letter: the log-prob goes on the first occurrence of `decided`.
        reasoning = "Several options are given; the most complete one looks right." if think else ""
        return Turn(text=f"The answer is \\boxed{{{letter}}}.", reasoning=reasoning, logprob=logprob, decided=letter)

    found = find_arithmetic(prompt)
    if found is None:
        return Turn(
            text="I am not sure how to answer that.", reasoning="I see nothing I can work out." if think else ""
        )
    expression, value, ops = found
    slipped, logprob = sample_slip(rng, 1.0 - (1.0 - error_rate) ** max(ops, 1), temperature, top_p)
    if slipped:
        value = Fraction(value.numerator + rng.choice([-1, 1]), value.denominator)
    answer = latex(value)
    reasoning = f"I need to compute {expression} step by step." if think else ""
    return Turn(
        text=f"{expression} = {answer}.\nThe answer is \\boxed{{{answer}}}.",
        reasoning=reasoning,
        logprob=logprob,
        decided=answer,
    )
