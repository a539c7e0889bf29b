"""``python -m concerto_jax.gpu_check --out DIR`` (the package docstring says what it checks)."""

import sys

from concerto_jax.gpu_check.check import main

sys.exit(main())
