"""A third-party training step through optimize(): Penzai's StatefulTrainer on a Llama-like model.

    pip install penzai==0.2.5     # light: absl-py, ordered-set, treescope; jax untouched
    python -m bench.third_party_penzai [--steps 3]

The step is Penzai's own, built by ``bench.third_party.penzai_parts`` (the builder of
``python -m bench.third_party --trainer penzai``'s rows): ``StatefulTrainer``'s ``jax.jit`` of
``_stateful_trainer_step`` on ``build_llamalike_transformer`` (f32 params, bf16 activations),
FSDP over ``data`` x TP over ``model`` (2 x 4 CPU devices), synthetic tokens, here at a tiny
width (d 64, 2 blocks, vocabulary 256). Each mode (identity; recompiled module, no fallback)
trains a fresh copy and must give the reference trainer's params bitwise. Prints one line per
mode; exit status 1 on any difference. ``bench.third_party``'s Penzai rows run the same step
through ``compile_for_target`` (d 2048) and through ``optimize`` with the passes on.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import dataclasses

    import numpy as np
    from penzai import pz

    import concerto_jax
    from bench.third_party import penzai_parts, penzai_tokens

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    build_trainer, _, _ = penzai_parts(64, 2, vocab=256, heads=4, mlp=128)
    tokens = penzai_tokens(8, 32, 256, mesh)

    def params_of(trainer):
        return [np.asarray(v.value.unwrap(*v.value.named_axes) if hasattr(v.value, "named_axes")
                           else v.value)
                for v in pz.unbind_params(trainer.model)[1]]

    reference = build_trainer(mesh)
    ref_losses = [float(reference.step(tokens=tokens)["loss"]) for _ in range(args.steps)]
    ref_params = params_of(reference)
    failed = False
    modes = {"identity": concerto_jax.Options(fallback=False),
             "recompile": concerto_jax.Options(
                 fallback=False, optimize=concerto_jax.OptimizeOptions(always_recompile=True))}
    for name, options in modes.items():
        trainer = build_trainer(mesh)
        opt = concerto_jax.optimize(trainer.step_fn, options)
        trainer = dataclasses.replace(trainer, step_fn=opt)
        losses = [float(trainer.step(tokens=tokens)["loss"]) for _ in range(args.steps)]
        got = params_of(trainer)
        same = losses == ref_losses and all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                            for a, b in zip(got, ref_params, strict=True))
        rep = opt.report()
        print(f"penzai llamalike (f32 params, bf16 activations), FSDPxTP 2x4, "
              f"{args.steps} steps, {name}: bitwise={same} losses={losses} "
              f"executable={rep.executable} check={rep.first_step_check!r} "
              f"collectives={rep.collectives}", flush=True)
        failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
