"""Errors jaxspec raises for bad input, always before anything is traced or jitted, and the one
type test every count and id in a request goes through.

Each names what was wrong so a user (or the CLI, which prints one line and exits 2) can act on it.
"""

import numpy as np


class JaxspecError(ValueError):
    """Base class: bad input the user can fix."""


class CheckpointError(JaxspecError):
    """A checkpoint file or directory is missing, truncated or corrupt."""


class UnsupportedModelError(JaxspecError):
    """The checkpoint is readable but describes something jaxspec does not implement."""


class InvalidRequestError(JaxspecError):
    """A generation request is out of range (prompt, token ids, sampling parameters, lengths).

    `flag`: the CLI flag the whole error is about, where its text names the parts of that one
    value (a DraftTree's depth, top_k and num_nodes are parts of --tree, not the sampling
    --top-k): the CLI then prints "FLAG: message" as written instead of renaming the options
    the message names."""

    def __init__(self, message: str, *, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


def is_integer(value) -> bool:
    """An int or numpy integer, and not a bool (True is an int to Python, never a count or an id)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)



def check_text(text: str, what: str) -> None:
    """InvalidRequestError when `text` holds a lone surrogate (argv's undecodable bytes arrive as
    one): it is not text, and no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            f"{what} holds {text[err.start]!r} at index {err.start}, a lone surrogate that is not text "
            "(decode the source with errors='replace')") from None
