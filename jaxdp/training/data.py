"""The default model's training data: small skills whose answers can be checked, generated here.

Skills (prompt -> answer): `add` "37+48=" -> "85", `sub` "91-17=" -> "74" (never negative), `mul`
"23*4=" -> "92" (a number below 100 times a digit, either order), `mul3` "123*4=" -> "492" (the same
with 100..999), `count` "count a abcab=" -> "2", `sort` "sort 3142=" -> "1234", `reverse` "reverse
cat=" -> "tac", and two with long answers (what a speculative decoder's draft earns its keep on):
`long_reverse` "reverse S=" and `long_sort` "sort S=" with S of 16 to 64 lowercase letters ("LONG",
reported together as "long"). A prompt is shown plain ("37+48=") or wrapped in the chat template
(`<bos><|user|>37+48=<|assistant|>`); the answer follows, then `<eos>`. "Arithmetic", the figure the
default model is held to, is add, sub and mul; `mul3` is there to teach `mul`: `mul` has 2,000 prompts,
few enough that a small model memorises the training ones and misses the held-out ones (82% held-out
with the loss near 0), while `mul3`'s 18,000 leave it no way but the digit-by-digit product, which
`mul` then shares (99%).

Everything is deterministic: training example i of seed s is drawn from its own generator
(`np.random.default_rng([s, i])`), so the stream does not depend on the order it is read in. The split is
a hash of the prompt: about 10% of all prompts of a skill are held out and never trained on, so an
evaluation measures the skill, not memory. `train_dataset` is a grain `MapDataset` of padded token
batches with a loss mask on the answer tokens (and the eos).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable

import grain
import numpy as np

from jaxdp.tokenizer import Tokenizer

SKILLS = ("add", "sub", "mul", "mul3", "count", "sort", "reverse", "long_reverse", "long_sort")
ARITHMETIC = ("add", "sub", "mul")
LONG = ("long_reverse", "long_sort")
SKILL_WEIGHTS = {"add": 0.16, "sub": 0.12, "mul": 0.23, "mul3": 0.21, "count": 0.05, "sort": 0.05, "reverse": 0.05,
                 "long_reverse": 0.065, "long_sort": 0.065}
HELD_OUT_PERMILLE = 100  # 10% of each skill's prompts are held out
HELD_OUT_SEED = 1234  # the held-out sample an evaluation uses (the split itself does not depend on it)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LONG_MIN, LONG_MAX = 16, 64  # letters in a long skill's word
SEQ_LEN = 144  # token rows per training sequence (the longest example, chat-wrapped, is 2 * 64 + 13 = 141)


@dataclasses.dataclass(frozen=True)
class Problem:
    skill: str
    prompt: str  # "37+48="
    answer: str  # "85"


def _add(rng: np.random.Generator) -> tuple[str, str]:
    a, b = rng.integers(0, 100, 2)
    return f"{a}+{b}=", str(a + b)


def _sub(rng: np.random.Generator) -> tuple[str, str]:
    a, b = sorted(rng.integers(0, 100, 2).tolist(), reverse=True)
    return f"{a}-{b}=", str(a - b)


def _times_digit(rng: np.random.Generator, low: int, high: int) -> tuple[str, str]:
    a, d = int(rng.integers(low, high)), int(rng.integers(0, 10))
    return (f"{a}*{d}=" if rng.random() < 0.5 else f"{d}*{a}="), str(a * d)


def _mul(rng: np.random.Generator) -> tuple[str, str]:
    return _times_digit(rng, 0, 100)


def _mul3(rng: np.random.Generator) -> tuple[str, str]:
    return _times_digit(rng, 100, 1000)


def _count(rng: np.random.Generator) -> tuple[str, str]:
    alphabet = LETTERS[:4]
    word = "".join(rng.choice(list(alphabet), int(rng.integers(3, 8))))
    c = alphabet[int(rng.integers(0, len(alphabet)))]
    return f"count {c} {word}=", str(word.count(c))


def _sort(rng: np.random.Generator) -> tuple[str, str]:
    digits = "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(3, 6))))
    return f"sort {digits}=", "".join(sorted(digits))


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
    word = "".join(rng.choice(list(LETTERS), int(rng.integers(3, 6))))
    return f"reverse {word}=", word[::-1]


def _long_word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(LETTERS), int(rng.integers(LONG_MIN, LONG_MAX + 1))))


def _long_reverse(rng: np.random.Generator) -> tuple[str, str]:
    word = _long_word(rng)
    return f"reverse {word}=", word[::-1]


def _long_sort(rng: np.random.Generator) -> tuple[str, str]:
    word = _long_word(rng)
    return f"sort {word}=", "".join(sorted(word))


GENERATORS: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "mul3": _mul3, "count": _count, "sort": _sort, "reverse": _reverse,
    "long_reverse": _long_reverse, "long_sort": _long_sort,
}


def is_held_out(skill: str, prompt: str) -> bool:
    """The split: a stable hash of the prompt (never Python's salted `hash`)."""
    h = hashlib.blake2b(f"{skill}|{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 1000 < HELD_OUT_PERMILLE


def sample_problem(rng: np.random.Generator, skill: str, held_out: bool) -> Problem:
    """A problem of `skill` from the training split (held_out=False) or the held-out split."""
    while True:
        prompt, answer = GENERATORS[skill](rng)
        if is_held_out(skill, prompt) == held_out:
            return Problem(skill, prompt, answer)


def parse_mix(text: str) -> dict[str, float]:
    """"add=0.2,mul=0.4,..." -> the skill weights, every skill named once, normalised to sum 1."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or name not in SKILLS or weight < 0 or name in mix:
            raise ValueError(f"--mix {text!r}: expected SKILL=WEIGHT for each of {', '.join(SKILLS)}, "
                             f"weights >= 0 (at {item.strip()!r})")
        mix[name] = weight
    if set(mix) != set(SKILLS) or sum(mix.values()) <= 0:
        raise ValueError(f"--mix {text!r}: name every skill once ({', '.join(SKILLS)}), weights summing above 0")
    total = sum(mix.values())
    return {s: mix[s] / total for s in SKILLS}


def format_mix(mix: dict[str, float]) -> str:
    return ",".join(f"{s}={mix[s]:g}" for s in SKILLS)


def training_example(seed: int, index: int, mix: dict[str, float] | None = None) -> tuple[Problem, bool]:
    """Example `index` of the training stream of `seed` and skill weights `mix` (default SKILL_WEIGHTS):
    (problem, whether it is chat-wrapped)."""
    mix = mix or SKILL_WEIGHTS
    rng = np.random.default_rng([seed, index])
    skill = SKILLS[int(rng.choice(len(SKILLS), p=[mix[s] for s in SKILLS]))]
    chat = bool(rng.random() < 0.5)
    return sample_problem(rng, skill, held_out=False), chat


def held_out_problems(n_per_skill: int, skills: tuple[str, ...] = SKILLS, seed: int = HELD_OUT_SEED
                      ) -> list[Problem]:
    """Distinct held-out problems, `n_per_skill` of each skill (fewer if the split has fewer)."""
    out: list[Problem] = []
    for k, skill in enumerate(skills):
        rng = np.random.default_rng([seed, k])
        seen: set[str] = set()
        for _ in range(50 * n_per_skill):
            if len(seen) == n_per_skill:
                break
            p = sample_problem(rng, skill, held_out=True)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
    return out


def prompt_text(tok: Tokenizer, problem: Problem, chat: bool) -> str:
    """The text the model reads before answering: chat-wrapped, or plain (the tokenizer adds bos)."""
    if chat:
        return tok.apply_chat_template([{"role": "user", "content": problem.prompt}])
    return problem.prompt


def example_ids(tok: Tokenizer, problem: Problem, chat: bool) -> tuple[list[int], list[float]]:
    """Token ids of prompt + answer + eos, and a 0/1 weight per id: 1 on the ids the model must produce."""
    prompt_ids = tok.encode(prompt_text(tok, problem, chat))
    answer_ids = tok.encode(problem.answer, add_special_tokens=False) + [tok.eos_token_id]
    return prompt_ids + answer_ids, [0.0] * len(prompt_ids) + [1.0] * len(answer_ids)


@dataclasses.dataclass(frozen=True)
class PackShape:
    """A packed group: `rows` token rows holding whole sequences back to back (each its own sequence,
    positions from 0), at most `max_seqs` of them, none longer than `max_len` (the page size)."""

    rows: int = 192
    max_seqs: int = 12
    max_len: int = SEQ_LEN


def pack_group(seqs: list[tuple[list[int], list[float]]], shape: PackShape, pad_id: int
               ) -> dict[str, np.ndarray]:
    """One flat group: tokens, labels (the next id of the same sequence), loss mask, positions, the
    sequence of each row (max_seqs for padding) and each sequence's length."""
    R = shape.rows
    out = {"tokens": np.full(R, pad_id, np.int32), "labels": np.full(R, pad_id, np.int32),
           "loss_mask": np.zeros(R, np.float32), "positions": np.zeros(R, np.int32),
           "seq": np.full(R, shape.max_seqs, np.int32), "seq_lens": np.zeros(shape.max_seqs, np.int32)}
    row = 0
    for j, (ids, weights) in enumerate(seqs):
        n = len(ids)
        if j >= shape.max_seqs or row + n > R or n > shape.max_len:
            raise ValueError(f"sequence {j} ({n} tokens) does not fit a group of {shape}")
        out["tokens"][row:row + n] = ids
        out["labels"][row:row + n - 1] = ids[1:]
        out["loss_mask"][row:row + n - 1] = weights[1:]
        out["positions"][row:row + n] = np.arange(n)
        out["seq"][row:row + n] = j
        out["seq_lens"][j] = n
        row += n
    return out


def train_batches(tok: Tokenizer, seed: int, groups_per_batch: int, shape: PackShape = PackShape(),
                  mix: dict[str, float] | None = None):
    """An endless, deterministic stream of training batches: each {key: [groups_per_batch, ...]} of packed
    groups (`pack_group`). Examples come from a grain `MapDataset` (example i of `seed`, see
    `training_example`) read in order and packed first-fit into consecutive groups."""

    def make(index: int) -> tuple[list[int], list[float]]:
        problem, chat = training_example(seed, index, mix)
        return example_ids(tok, problem, chat)

    dataset = grain.MapDataset.range(0, 1 << 40).map(make)
    examples = (dataset[i] for i in itertools.count())  # in order; random access needs no threads
    pending = next(examples)
    while True:
        groups = []
        for _ in range(groups_per_batch):
            seqs, used = [], 0
            while len(seqs) < shape.max_seqs and used + len(pending[0]) <= shape.rows:
                seqs.append(pending)
                used += len(pending[0])
                pending = next(examples)
            if not seqs:
                raise ValueError(f"a packed group of {shape.rows} rows cannot hold an example of "
                                 f"{len(pending[0])} tokens; give --rows {SEQ_LEN} or more")
            groups.append(pack_group(seqs, shape, tok.pad_token_id))
        yield {k: np.stack([g[k] for g in groups]) for k in groups[0]}
