"""The synthetic language: a seeded pseudo-language for runs without `data.path`."""

from __future__ import annotations

import numpy as np

VALID_FRACTION = 0.1


_ONSETS = [
    "",
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "sh",
    "th",
    "ch",
    "br",
    "st",
    "tr",
    "kl",
    "gr",
]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "k"]


def synthetic_corpus(n_words: int, seed: int, vocab: int = 500, branching: int = 8) -> tuple[str, str]:
    """A seeded pseudo-language: (train text of ~n_words words, valid text of ~n_words/10 words).

    `vocab` syllable-built words (frequent ones shorter) follow a sparse Markov chain: each word has
    `branching` possible successors drawn from a Zipf prior, picked with Zipf-decaying weights; each
    word has its own chance of ending the sentence or taking a comma. So a bigram model predicts much
    better than word frequencies alone, and word frequencies come out roughly Zipfian.
    """
    rng = np.random.Generator(np.random.PCG64([seed, 0]))
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < vocab:
        n_syl = 1 + min(2, int(rng.exponential(0.3 + 1.2 * len(words) / vocab)))
        w = "".join(str(rng.choice(_ONSETS)) + str(rng.choice(_NUCLEI)) + str(rng.choice(_CODAS)) for _ in range(n_syl))
        if len(w) > 1 and w not in seen:
            seen.add(w)
            words.append(w)
    prior = 1.0 / np.arange(1, vocab + 1) ** 0.8
    prior /= prior.sum()
    succ = np.stack([rng.choice(vocab, branching, replace=False, p=prior) for _ in range(vocab + 1)])
    slot_p = 1.0 / np.arange(1, branching + 1) ** 1.2
    slot_p /= slot_p.sum()
    end_p = rng.beta(1.5, 12.0, vocab)  # sentences of about ten words
    comma_p = rng.beta(1.0, 25.0, vocab)
    lang = (words, succ.tolist(), slot_p, end_p.tolist(), comma_p.tolist())
    valid_words = max(1, round(n_words * VALID_FRACTION))
    return (
        _generate(lang, n_words, np.random.Generator(np.random.PCG64([seed, 1]))),
        _generate(lang, valid_words, np.random.Generator(np.random.PCG64([seed, 2]))),
    )


def _generate(lang: tuple, n: int, rng: np.random.Generator) -> str:
    """Walk the chain for `n` words; row `vocab` of the successor table holds the sentence starters."""
    words, succ, slot_p, end_p, comma_p = lang
    start = len(words)
    slots = rng.choice(len(slot_p), n, p=slot_p).tolist()
    u = rng.random(n).tolist()
    v = rng.random(n).tolist()
    parts = []
    w = succ[start][slots[0]]
    cap = True
    for t in range(n):
        s = words[w].capitalize() if cap else words[w]
        if u[t] < end_p[w]:
            parts.append(s + (".\n" if v[t] < 0.15 else ". "))
            w, cap = succ[start][slots[t]], True
        else:
            parts.append(s + (", " if v[t] < comma_p[w] else " "))
            w, cap = succ[w][slots[t]], False
    return "".join(parts).rstrip(" ,.\n") + ".\n"
