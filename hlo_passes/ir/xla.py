"""Bridges to XLA's own HLO parser and printer (jaxlib), used to validate our text."""

from __future__ import annotations

__all__ = ["xla_parse", "xla_canonical", "xla_print_options"]


def _hlo():
    # jaxlib's HLO bindings, through concerto_jax.jax_compat (the one module that touches
    # JAX's internals)
    from concerto_jax import jax_compat  # lazy: no JAX start-up when the IR is imported

    return jax_compat.xla_client().hlo


def xla_print_options():
    """XLA's print options used for canonical text: everything printed, large
    constants in full, metadata and backend configs included."""
    options = _hlo().HloPrintOptions()
    options.print_large_constants = True
    options.print_metadata = True
    options.print_backend_config = True
    return options


def xla_parse(text: str):
    """Parses HLO text with XLA's parser.

    Returns:
      A ``jaxlib`` ``HloModule``.

    Raises:
      Exception: whatever XLA raises for text it rejects (``XlaRuntimeError``
        or ``ValueError`` depending on the jaxlib version).
    """
    from concerto_jax import jax_compat  # lazy: see _hlo

    return jax_compat.hlo_module_from_text(text)


def xla_canonical(text: str) -> str:
    """XLA's canonical printing of the module in ``text``.

    Two texts describe the same module for XLA exactly when their canonical
    texts are equal; this is how printer output is checked against the original.
    """
    return xla_parse(text).to_string(xla_print_options())
