"""diffattn: differential attention (Differential Transformer V1 and DIFF V2) on the CPU.

The fused C++ kernels of the diffattn library over numpy arrays, without copies:

    import diffattn
    out, lse = diffattn.diff_attention_v2(q, k, v, lambda_logit, causal=True)

Names mirror the C++ API; the options are keyword arguments with the C++ names
(causal, window_left, window_right, scale, num_threads). Arrays are float32 or
float64 (float16 and bfloat16 where the C++ side takes 16-bit storage; numpy has
no bfloat16, so its bits travel as uint16 arrays, which diffattn.torch does for
torch.bfloat16 tensors without a copy). Any strides are taken as they are
(in elements, as C++ TensorView strides); the last axis must be contiguous.
Outputs are new arrays unless out= (and lse=, dq=, ...) are given. Bad input
raises diffattn.Error, a ValueError carrying the C++ message. The kernels run
with the GIL released on the library's OpenMP threads (num_threads=0: the
OpenMP default), on the instruction-set variant diffattn.isa() names.

`import diffattn.torch` (when PyTorch is installed) adds autograd Functions
and nn.Modules over the same kernels.
"""

import numpy as _np

from . import _diffattn
from ._diffattn import (  # noqa: F401
    Error,
    KVCache_bfloat16,
    KVCache_float8_e4m3,
    KVCache_float16,
    KVCache_float32,
    KVCache_float64,
    KVCache_int8,
    MultiheadDiffAttnV1_float32,
    MultiheadDiffAttnV1_float64,
    MultiheadDiffAttnV2_float32,
    MultiheadDiffAttnV2_float64,
    PackedSequences,
    __version__,
    attention,
    attention_backward,
    attention_kvcache,
    attention_stats,
    attention_varlen,
    attention_varlen_backward,
    diff_attention_v1,
    diff_attention_v1_backward,
    diff_attention_v1_kvcache,
    diff_attention_v1_stats,
    diff_attention_v1_varlen,
    diff_attention_v1_varlen_backward,
    diff_attention_v2,
    diff_attention_v2_backward,
    diff_attention_v2_kvcache,
    diff_attention_v2_stats,
    diff_attention_v2_varlen,
    diff_attention_v2_varlen_backward,
    diff_weights,
    isa,
    isa_supported,
    isa_variants,
    lambda_init,
    merge_states,
    quantize_rows,
)

__all__ = [
    "Error", "PackedSequences", "MultiheadDiffAttnV1", "MultiheadDiffAttnV2",
    "attention", "attention_backward", "attention_kvcache", "attention_varlen",
    "attention_varlen_backward", "diff_attention_v1", "diff_attention_v1_backward",
    "diff_attention_v1_kvcache", "diff_attention_v1_varlen",
    "diff_attention_v1_varlen_backward", "diff_attention_v2", "diff_attention_v2_backward",
    "diff_attention_v2_kvcache", "diff_attention_v2_varlen",
    "diff_attention_v2_varlen_backward", "diff_weights", "isa", "isa_supported",
    "isa_variants", "lambda_init", "merge_states", "quantize_rows",
    "diff_attention_v1_stats", "diff_attention_v2_stats", "attention_stats",
]

Error.__module__ = "diffattn"

_V1 = {_np.dtype(_np.float32): MultiheadDiffAttnV1_float32,
       _np.dtype(_np.float64): MultiheadDiffAttnV1_float64}
_V2 = {_np.dtype(_np.float32): MultiheadDiffAttnV2_float32,
       _np.dtype(_np.float64): MultiheadDiffAttnV2_float64}


def _layer_class(table, name, dtype):
    try:
        return table[_np.dtype(dtype)]
    except (KeyError, TypeError):
        raise Error(f"{name}: dtype must be float32 or float64, got {dtype!r}") from None


def MultiheadDiffAttnV1(embed_dim, depth, num_heads, num_kv_heads=0, *, dtype=_np.float32,
                        **kwargs):
    """The DIFF V1 layer (split heads), the reference module's parameters.

    MultiheadDiffAttnV1(embed_dim, depth, num_heads, num_kv_heads=0, *, dtype=float32,
    causal=True, rope=True, norm_affine=True, rope_base=10000, window_left=-1,
    window_right=-1, head_dim=0, norm_eps=1e-5, seed=0): num_heads DIFF heads of
    head_dim = embed_dim / (2 num_heads) (query/key halves; values twice as wide),
    num_kv_heads 0 meaning num_heads. Methods: forward(x) (B, N, E) -> (B, N, E),
    forward(x, cache), forward(x, PackedSequences), backward(dy) -> dx (adds the
    parameters' gradients), parameters() and gradients() (name -> writable numpy
    view over the layer), zero_grad(), make_cache(batch, capacity, dtype=None),
    load_safetensors(path, prefix="", layout="native"), save_safetensors(path,
    prefix=""), lambda_full(), lambda_init(), attention_maps(x), set_num_threads(n).
    """
    return _layer_class(_V1, "MultiheadDiffAttnV1", dtype)(
        embed_dim, depth, num_heads, num_kv_heads or 0, **kwargs)


def MultiheadDiffAttnV2(embed_dim, depth, num_heads, num_kv_heads=0, *, dtype=_np.float32,
                        **kwargs):
    """The DIFF V2 layer (doubled query heads), the reference module's parameters.

    MultiheadDiffAttnV2(embed_dim, depth, num_heads, num_kv_heads=0, *, dtype=float32,
    head_dim=0, causal=True, rope=True, rope_base=10000, window_left=-1,
    window_right=-1, seed=0): num_heads DIFF heads from 2 num_heads query heads of
    head_dim = embed_dim / num_heads, lambda = sigmoid(x lambda_proj^T) per token and
    head. depth is accepted for the reference's signature and unused (V2 has no
    lambda_init). Methods as MultiheadDiffAttnV1's (no lambda_full, no layout).
    """
    return _layer_class(_V2, "MultiheadDiffAttnV2", dtype)(
        embed_dim, depth, num_heads, num_kv_heads or 0, **kwargs)
