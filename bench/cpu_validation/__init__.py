"""CPU validation of the cost model's method (``python -m bench.cli validate-cpu``): XLA:CPU kernels
measured one by one into a ``ProfileStore`` and by an analytic model of XLA:CPU's kernel classes,
each prediction compared with the whole program's measured time.

No GPU here, so the *method* is validated on the host CPU: for a single-device jitted program,
every kernel of XLA:CPU's optimized module is compiled as its own module and timed
(``measure.py``); the per-kernel times go into a ``ProfileStore`` keyed by signature, and
simulating the program's task graph with them should predict the whole-program time, and so
should the analytic model (``rates.py``: every kernel classified by what XLA:CPU runs it as and
costed at its class's rate, each rate measured by its own probe). ``host.py`` pins XLA:CPU to
one core and counts page faults; ``validate.py`` compares (``validate_program``). Dependencies:
``host``, ``measure`` <- ``rates`` <- ``validate``.
"""

from bench.cpu_validation.host import keep_freed_memory, page_faults_per_run, pin_to_one_cpu
from bench.cpu_validation.measure import (
    Best,
    KernelProfile,
    compile_hlo_cpu,
    hlo_cpu_runner,
    in_program_kernel_us,
    interleaved_best,
    profile_module_on_cpu,
    standalone_kernel_us,
    standalone_module,
)
from bench.cpu_validation.rates import (
    CPU_COMPUTE_OPTIONS,
    KERNEL_CLASSES,
    CpuRates,
    CpuSpecProbes,
    cpu_kernel_class,
    cpu_kernel_model,
    cpu_kernel_time_us,
    cpu_spec_probes,
    measure_cpu_rates,
    measure_cpu_spec,
    rates_from_spec,
)
from bench.cpu_validation.validate import (
    KernelRow,
    ValidationRow,
    dispatch_twin,
    mean_abs_error_pct,
    validate_program,
)

__all__ = [
    "CPU_COMPUTE_OPTIONS", "KERNEL_CLASSES", "Best", "CpuRates", "CpuSpecProbes", "KernelProfile",
    "KernelRow", "ValidationRow", "compile_hlo_cpu", "cpu_kernel_class", "cpu_kernel_model",
    "cpu_kernel_time_us", "cpu_spec_probes", "dispatch_twin", "hlo_cpu_runner", "in_program_kernel_us",
    "interleaved_best", "keep_freed_memory", "mean_abs_error_pct", "measure_cpu_rates",
    "measure_cpu_spec", "page_faults_per_run", "pin_to_one_cpu", "profile_module_on_cpu",
    "rates_from_spec", "standalone_kernel_us", "standalone_module", "validate_program",
]
