"""Math word problems from DeepMind's mathematics_dataset (Apache-2.0, generated on the fly),
wrapped in natural requests; seeded, and deterministic where the package itself was not.

mathematics_dataset 1.0.1 predates sympy 1.14 and numpy 2: `_mathematics_modules` patches the
sympy import it needs, and leaves out the modules that fail on numpy 2 (`ndarray.itemset`):
calculus.differentiate, calculus.differentiate_composed, polynomials.coefficient_named,
polynomials.add, polynomials.expand, polynomials.collect, polynomials.compose. Some *_composed
modules call those internally now and then; such a draw is retried, and a module that keeps
failing is dropped for the rest of the draw. Its composed problems also drew from hash- and
id-ordered sets, so a seed did not fix them: `_make_composition_deterministic` orders them.
"""

from __future__ import annotations

import functools
import importlib
import logging
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxspec.errors import InvalidRequestError
from jaxspec.train.corpus.generation import _check_count, _derive_seed

logger = logging.getLogger(__name__)


BROKEN_MATH_MODULES = frozenset({
    "calculus.differentiate", "calculus.differentiate_composed", "polynomials.coefficient_named",
    "polynomials.add", "polynomials.expand", "polynomials.collect", "polynomials.compose",
})  # they call ndarray.itemset, gone in numpy 2
MATH_REQUESTS = (
    "Solve this and explain each step: {question}",
    "Can you help me with this math problem? {question}",
    "Work through the following problem, showing your reasoning.\n\n{question}",
    "Here is a question from my homework: {question} How do I solve it?",
    "{question} Explain how you get the answer.",
    "I'm stuck on this one: {question}",
)
_MATH_ATTEMPTS = 20  # draws of one module in a row that may fail before it is dropped


@functools.cache
def _mathematics_modules() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(area.name, problem generator) of every mathematics_dataset module that runs here, sorted."""
    try:
        importlib.import_module("sympy.solvers.diophantine")
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        # mathematics_dataset imports base_solution_linear from the package, which sympy 1.14 no
        # longer re-exports; the package attribute is shadowed by the diophantine() function.
        sys.modules["sympy.solvers.diophantine"].base_solution_linear = base_solution_linear
    except ImportError:
        pass  # an older sympy exports it already
    try:
        from mathematics_dataset.modules import modules
        from mathematics_dataset.util import composition
    except ImportError as error:
        raise InvalidRequestError(
            "math prompts need DeepMind's mathematics_dataset: pip install mathematics-dataset "
            f"(or pip install 'jaxspec[train]'); importing it failed: {error}") from None
    _make_composition_deterministic(composition)
    found = modules.train(lambda entropy: entropy)
    return tuple(sorted((f"{area}.{name}", generator) for area, generators in found.items()
                        for name, generator in generators.items() if f"{area}.{name}" not in BROKEN_MATH_MODULES))


def _make_composition_deterministic(composition: Any) -> None:
    """The composed problems draw from sets: of letters (`Context.pop`, ordered by string hashes,
    which PYTHONHASHSEED salts) and of entities (`expand_entities`, ordered by object ids), so
    the same seed gave different problems. Both draw from an ordered list instead (the same
    random calls, so nothing else changes)."""
    if getattr(composition, "_jaxspec_deterministic", False):
        return

    def pop(self):
        allowed = (composition._ALLOWED_SYMBOLS.difference(self._relation_symbols)
                   .difference(self._self_symbols).difference(self._child_symbols))
        if not allowed:
            raise ValueError("Ran out of symbols")
        symbol = random.choice(sorted(allowed))
        self._self_symbols.add(symbol)
        return symbol

    def expand_entities(context, **kwargs):  # composition.expand_entities, its set made a list in order
        kwargs = kwargs.copy()
        entities = list(context.child_entities)
        for key, maybe_entity in kwargs.items():
            if isinstance(maybe_entity, composition.Entity):
                entities.append(maybe_entity)
                kwargs[key] = maybe_entity.handle
        entities = list(dict.fromkeys(entities))
        random.shuffle(entities)
        descriptions = []
        for entity in entities:
            descriptions.append(entity.child_description)
            if not entity.expression_used:
                descriptions.append(entity.description)
        return " ".join(d for d in descriptions if d), kwargs

    composition.Context.pop = pop
    composition.expand_entities = expand_entities
    composition._jaxspec_deterministic = True


def math_modules() -> list[str]:
    """The mathematics_dataset modules `math_prompts` draws from (area.name)."""
    return [name for name, _ in _mathematics_modules()]


def math_problems(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` distinct (module, question) pairs, round-robin over a seeded order of the working
    modules. The dataset draws from Python's, numpy's and sympy's global generators: all are
    seeded here and restored afterwards, and its set-ordered draws are made ordered
    (`_make_composition_deterministic`), so the result depends on `seed` alone, in any process,
    and callers' streams are left as they were."""
    _check_count("count", count, 0)
    import sympy.core.random as sympy_random  # randprime draws from sympy's own generators

    generators = list(_mathematics_modules())
    order = np.random.default_rng([seed, 0x3A7]).permutation(len(generators))
    generators = [generators[i] for i in order]
    sympy_generators = (sympy_random.rng, sympy_random._assumptions_rng)
    saved = random.getstate(), np.random.get_state(), [g.getstate() for g in sympy_generators]
    problems: dict[str, str] = {}
    try:
        random.seed(seed)
        np.random.seed(_derive_seed("math", seed))
        sympy_random.seed(_derive_seed("math-sympy", seed))
        slot = 0
        while len(problems) < count and generators:
            name, generator = generators[slot % len(generators)]
            for _ in range(_MATH_ATTEMPTS):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        question = " ".join(str(generator().question).split())
                    break
                except Exception:  # noqa: BLE001 - a numpy-2 failure inside the old package
                    question = None
            if question is None:
                logger.warning("mathematics_dataset module %s fails on every draw; left out", name)
                generators.remove((name, generator))
                continue
            problems.setdefault(question, name)
            slot += 1
            if slot > 20 * count + 100:
                break  # modules whose questions keep repeating: return what there is
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        for generator, state in zip(sympy_generators, saved[2]):
            generator.setstate(state)
    return [(name, question) for question, name in problems.items()]


def math_prompts(count: int, seed: int) -> list[str]:
    """`count` math word problems from mathematics_dataset (`math_problems`), each wrapped in one
    of a few natural request phrasings (seeded)."""
    return [wrapped for _, wrapped in _wrapped_math(count, seed)]


def _wrapped_math(count: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng([seed, 0x3A8])
    return [(module, MATH_REQUESTS[int(rng.integers(len(MATH_REQUESTS)))].format(question=question))
            for module, question in math_problems(count, seed)]
