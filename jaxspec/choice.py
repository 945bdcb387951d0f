"""`Choice`: the base of jaxspec's option enums (attention path, KV and weight formats, matmul
implementation), so each parses its values and refuses anything else the same way."""

import enum

from jaxspec.errors import InvalidRequestError


class Choice(enum.Enum):
    """An option with a fixed set of values (an attention path, a KV or weight format, ...):
    `parse` takes a member or its value and refuses anything else by listing the valid ones."""

    @classmethod
    def label(cls) -> str:
        """What the option is called in messages."""
        return cls.__name__.lower()

    @classmethod
    def parse(cls, name):
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            raise InvalidRequestError(
                f"unknown {cls.label()} {name!r}; choose from {[m.value for m in cls]}") from None
