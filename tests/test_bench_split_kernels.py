"""``bench.split_kernels``: the kernel classes of XLA's final modules, and the per-class difference."""

from bench import split_kernels

_FINAL = """HloModule m, is_scheduled=true

%gemm (p0: bf16[64,32], p1: bf16[32,16]) -> f32[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%sum_conv (a: f32[64,16], b: f32[64,16]) -> bf16[64,16] {
  %a = f32[64,16]{1,0} parameter(0)
  %b = f32[64,16]{1,0} parameter(1)
  %s = f32[64,16]{1,0} add(%a, %b)
  ROOT %c = bf16[64,16]{1,0} convert(%s)
}

%cat (x: bf16[64,16], y: bf16[64,16]) -> bf16[128,16] {
  %x = bf16[64,16]{1,0} parameter(0)
  %y = bf16[64,16]{1,0} parameter(1)
  ROOT %c = bf16[128,16]{1,0} concatenate(%x, %y), dimensions={0}
}

%add_f (u: f32[], v: f32[]) -> f32[] {
  %u = f32[] parameter(0)
  %v = f32[] parameter(1)
  ROOT %w = f32[] add(%u, %v)
}

%red (r: bf16[128,16]) -> f32[16] {
  %r = bf16[128,16]{1,0} parameter(0)
  %rc = f32[128,16]{1,0} convert(%r)
  %z = f32[] constant(0)
  ROOT %o = f32[16]{0} reduce(%rc, %z), dimensions={0}, to_apply=%add_f
}

%tanh_slice (t: bf16[128,16]) -> bf16[64,16] {
  %t = bf16[128,16]{1,0} parameter(0)
  %sl = bf16[64,16]{1,0} slice(%t), slice={[0:64], [0:16]}
  ROOT %th = bf16[64,16]{1,0} tanh(%sl)
}

ENTRY %main (x0: bf16[64,32], x1: bf16[64,32], w: bf16[32,16]) -> (bf16[64,16], f32[16]) {
  %x0 = bf16[64,32]{1,0} parameter(0)
  %x1 = bf16[64,32]{1,0} parameter(1)
  %w = bf16[32,16]{1,0} parameter(2)
  %g0 = f32[64,16]{1,0} fusion(%x0, %w), kind=kCustom, calls=%gemm
  %g1 = f32[64,16]{1,0} fusion(%x1, %w), kind=kCustom, calls=%gemm
  %s = bf16[64,16]{1,0} fusion(%g0, %g1), kind=kLoop, calls=%sum_conv
  %c = bf16[128,16]{1,0} fusion(%s, %s), kind=kLoop, calls=%cat
  %r = f32[16]{0} fusion(%c), kind=kInput, calls=%red
  %t = bf16[64,16]{1,0} fusion(%c), kind=kLoop, calls=%tanh_slice
  ROOT %out = (bf16[64,16]{1,0}, f32[16]{0}) tuple(%t, %r)
}
"""


def test_kernel_classes_of_a_final_module():
    classes = {k: v[0] for k, v in split_kernels.breakdown(_FINAL).items()}
    assert classes == {"gemm": 2, "add of two arrays": 1, "concatenate": 1, "reduction": 1,
                       "elementwise+slice": 1}


def test_class_rows_difference_and_total():
    stock = _FINAL.replace("%g1 = f32[64,16]{1,0} fusion(%x1, %w), kind=kCustom, calls=%gemm",
                           "%g1 = f32[64,16]{1,0} bitcast(%g0)")
    rows = {r["class"]: r for r in split_kernels.class_rows("m", stock, _FINAL)}
    assert rows["gemm"]["stock_kernels"] == 1 and rows["gemm"]["added_kernels"] == 1
    assert split_kernels.breakdown(_FINAL)["gemm"][1] > split_kernels.breakdown(stock)["gemm"][1]  # bytes
    assert rows["total"]["added_kernels"] == 1
    assert rows["concatenate"]["added_kernels"] == 0


def test_copies_back_to_back_stop_at_a_collective():
    """Two copies of a kernel (one in stock) count where they run one after the other with no
    collective started between them."""
    ours = """HloModule m, is_scheduled=true

%add_f (u: f32[], v: f32[]) -> f32[] {
  %u = f32[] parameter(0)
  %v = f32[] parameter(1)
  ROOT %w = f32[] add(%u, %v)
}

%t (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %b = f32[64]{0} tanh(%a)
}

ENTRY %main (x: f32[64], y: f32[64]) -> (f32[64], f32[64], f32[64], f32[64]) {
  %x = f32[64]{0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %k0 = f32[64]{0} fusion(%x), kind=kLoop, calls=%t, metadata={op_name="a/tanh"}
  %k1 = f32[64]{0} fusion(%y), kind=kLoop, calls=%t, metadata={op_name="a/tanh"}
  %k2 = f32[64]{0} fusion(%k0), kind=kLoop, calls=%t, metadata={op_name="b/tanh"}
  %ar = f32[64]{0} all-reduce(%k2), replica_groups={}, to_apply=%add_f
  %k3 = f32[64]{0} fusion(%k1), kind=kLoop, calls=%t, metadata={op_name="b/tanh"}
  ROOT %out = (f32[64]{0}, f32[64]{0}, f32[64]{0}, f32[64]{0}) tuple(%k1, %k2, %ar, %k3)
}
"""
    stock = (ours.replace('  %k1 = f32[64]{0} fusion(%y), kind=kLoop, calls=%t, metadata={op_name="a/tanh"}\n', "")
             .replace('  %k3 = f32[64]{0} fusion(%k1), kind=kLoop, calls=%t, metadata={op_name="b/tanh"}\n', "")
             .replace("tuple(%k1, %k2, %ar, %k3)", "tuple(%k0, %k2, %ar, %k2)"))
    assert split_kernels.copies_back_to_back(stock, ours) == (2, 1)  # a/tanh adjacent; b/tanh not
    no_collective = ours.replace("  %ar = f32[64]{0} all-reduce(%k2), replica_groups={}, to_apply=%add_f\n",
                                 "").replace(", %ar,", ", %k2,")
    assert split_kernels.copies_back_to_back(stock, no_collective) == (2, 2)
