"""A third-party training step through optimize(): Penzai's StatefulTrainer on a Llama-like model.

    pip install penzai==0.2.5     # light: absl-py, ordered-set, treescope; jax untouched
    python -m bench.third_party_penzai [--steps 3]

The step is Penzai's own (``penzai.toolshed.basic_training.StatefulTrainer``:
``jax.jit`` of ``_stateful_trainer_step`` with static ``loss_fn`` /
``optimizer_def``, a typed ``root_rng`` key folded per step), on
``build_llamalike_transformer`` with float32 params and bf16 activations,
FSDP over ``data`` x TP over ``model``
(2 x 4 CPU devices), synthetic tokens. Each mode (identity; recompiled module)
trains a fresh copy and must give the reference trainer's params bitwise.
Prints one line per mode; exit status 1 on any difference.
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

    import jax.numpy as jnp
    import numpy as np
    import optax
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common
    from penzai.toolshed import basic_training, sharding_util

    import concerto_jax

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=4, query_head_multiplier=1, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=2, vocab_size=256, mlp_variant="swiglu",
        tie_embedder_and_logits=False, parameter_dtype=jnp.float32,
        activation_dtype=jnp.bfloat16, use_layer_stack=False)
    shard = {"embedding": "data", "mlp": "model", "heads": "model", "head_groups": "model",
             "vocabulary": "model"}

    def loss_fn(*, model, state, rng, tokens):
        logits = model(tokens).unwrap("batch", "seq", "vocabulary").astype(jnp.float32)
        targets = jnp.roll(tokens.unwrap("batch", "seq"), -1, axis=1)
        log_probs = jax.nn.log_softmax(logits)
        loss = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
        return loss, state, {"loss": loss}

    rng = np.random.default_rng(0)
    tokens = pz.nx.wrap(jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)).tag("batch", "seq")
    tokens = sharding_util.name_to_name_device_put(tokens, mesh, {"batch": "data"})

    def fresh_trainer():
        model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
        for var in pz.unbind_params(model)[1]:
            var.value = sharding_util.name_to_name_device_put(var.value, mesh, shard)
        return basic_training.StatefulTrainer.build(
            root_rng=jax.random.key(42), model=model, optimizer_def=optax.adamw(1e-3),
            loss_fn=loss_fn, donate_states=True)

    def params_of(trainer):
        return [np.asarray(v.value.unwrap(*v.value.named_axes) if hasattr(v.value, "named_axes")
                           else v.value)
                for v in pz.unbind_params(trainer.model)[1]]

    reference = fresh_trainer()
    ref_losses = [float(reference.step(tokens=tokens)["loss"]) for _ in range(args.steps)]
    ref_params = params_of(reference)
    failed = False
    modes = {"identity": concerto_jax.Options(fallback=False),
             "recompile": concerto_jax.Options(
                 fallback=False, optimize=concerto_jax.OptimizeOptions(always_recompile=True))}
    for name, options in modes.items():
        trainer = fresh_trainer()
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
