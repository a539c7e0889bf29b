"""Pass ``pin``: opt-barriers that make XLA's GPU scheduler keep each collective's planned window
(docs/ARCHITECTURE.md F7).

The rewrite is exported here; the pass function is ``hlo_passes.pin.run.pin_pass``, reached
through ``hlo_passes.registry`` (this face does not import it).
"""

from hlo_passes.pin.rewrite import (
    ANCHOR_OPCODES,
    CHEAP_OPCODES,
    PinStats,
    Window,
    pin_window,
    pin_windows,
    windows_from_order,
)

__all__ = ["ANCHOR_OPCODES", "CHEAP_OPCODES", "PinStats", "Window", "pin_window", "pin_windows",
           "windows_from_order"]
