"""The GPU route of ``optimize``: our order of XLA's own scheduled module, compiled by XLA's
backend only, loaded on JAX's client behind the step's serialization header.

On a GPU, XLA's Python compile path reschedules whatever module it receives, so the plan is
handed to XLA's backend alone (the path ``compile_for_target`` uses deviceless, docs/DECISIONS.md
D10) and the executable comes back into JAX through serialization. Stages (any failure:
``GpuRouteError`` naming the stage; ``optimize`` then runs the original step with one warning)::

    stock_compile    the step lowered and compiled by JAX on the real client at the normal
                     optimisation level (GEMMs autotuned) with XLA's dumps: the post-SPMD module,
                     XLA's scheduled module (the one its post-scheduling pipelines receive), and
                     JAX's Compiled object (calling convention, IFRT header, host callbacks)
    plan             process 0 only, broadcast to the others: the rewriting passes (decompose,
                     fuse_collectives, ...) on the post-SPMD module; where one changed it, XLA's
                     pipeline on our module up to its scheduler (replicated compile on the real
                     client, dumped); "schedule" on XLA's scheduled module (every computation,
                     deviceless.reschedule.reschedule_text): the text handed to the backend
    target_config    the real devices' GpuTargetConfigProto: the shipped config of their device
                     kind, compute capability checked, SM count set (``device_target``)  [GPU]
    backend_compile  PJRT_Compile of the handed module, deviceless, run_backend_only (XLA keeps
                     the schedule), then PJRT_Executable_Serialize  [GPU]
    checksum         every process compiled the same text (SHA-256 agreed by all)
    load             checks before the runtime sees anything (a header-less blob, another device
                     count, another compute capability are errors here, never an abort there),
                     then deserialize_executable(step's header + payload, the step's devices,
                     compile options with the step's device assignment, the step's host
                     callbacks)  [the GPU client's side: gpu_check]
    layout_check     the loaded executable's entry_computation_layout equals the step's
    swap             JAX's MeshExecutable with our executable: JAX's calling convention
                     (donation, weak types, shardings, unused arguments)

With the plan cache (``Options.cache_dir``; one process) a later build of the same step,
options, devices, code and JAX reads the plan and the serialized executable an earlier build
stored (``plan_cache``'s route entries): plan, target_config and backend_compile are skipped,
every other stage runs; an executable the load refuses drops the entry and the step is built
anew.

Then ``api``'s first-step check (bitwise where only the order changed; the passes' declared
tolerance otherwise). Every stage's success is agreed by all processes
(``multiprocess.all_succeeded``): all run ours, or all fall back together.

The GPU-only steps are those marked [GPU] and the GPU client's load; ``gpu_check`` runs them on
a GPU machine. ``CpuRehearsal`` runs the same route on CPU devices (the stock compile, plan and
compile of the CPU path, every other stage as on a GPU): the tests and gpu_check's CPU half use it.
"""

from concerto_jax.gpu_route.route import (
    GPU_PLATFORMS,
    STAGES,
    Built,
    CpuRehearsal,
    Deviceless,
    DeviceTarget,
    GpuBackend,
    GpuRouteError,
    LoadRefused,
    Payload,
    Plan,
    StockCompile,
    backend_for,
    build,
    build_entry,
    check_layouts,
    check_payload,
    compile_deviceless,
    compile_payload,
    config_compute_capability,
    config_for_kind,
    device_target,
    entry_order,
    load_options,
    load_payload,
    order_kept,
    payload_device_count,
    plan_on_scheduled,
    rehearse,
)

__all__ = [
    "GPU_PLATFORMS", "STAGES", "Built", "CpuRehearsal", "DeviceTarget", "Deviceless", "GpuBackend",
    "GpuRouteError", "LoadRefused", "Payload", "Plan", "StockCompile", "backend_for", "build",
    "build_entry", "check_layouts", "check_payload", "compile_deviceless", "compile_payload",
    "config_compute_capability", "config_for_kind", "device_target", "entry_order", "load_options",
    "load_payload", "order_kept", "payload_device_count", "plan_on_scheduled", "rehearse",
]
