"""Structured outputs: a request's JSON schema, regex, choice or grammar (spec.py), compiled by
llguidance for the model's tokenizer (grammar.py), kept by each row of a decoder batch in order
(matcher.py) at the commit frontier every decoder shares (constraint.py)."""
from kstep.structured.spec import StructuredSpec

__all__ = ["StructuredSpec"]
