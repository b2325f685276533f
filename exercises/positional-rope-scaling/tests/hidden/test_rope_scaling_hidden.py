"""Hidden tests of positional-rope-scaling: Hugging Face's implementations are the oracle.

Transformers builds its RoPE tables from a config (``ROPE_INIT_FUNCTIONS``) and BLOOM its
ALiBi slopes (``_get_alibi_slopes``); nothing is downloaded.
"""

import torch


def hf_yarn(head_dim, theta, factor, original):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=4 * original,
                         rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                          "original_max_position_embeddings": original})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


def test_alibi_slopes_match_hugging_face(submission):
    """Every head count from 1 to 40, and 64: BLOOM's slopes."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for n in list(range(1, 41)) + [64]:
        out = submission.call("alibi_slopes", n)
        submission.expect_close(out, _get_alibi_slopes(n, torch.device("cpu")).double(), dtype=torch.float32,
                                tol=1e-6, name=f"alibi_slopes({n})")


def test_yarn_matches_hugging_face(submission):
    """Head dims 16-128, bases 1e4-1e6, original lengths 256-32768, factors 2-16, as HF's yarn computes."""
    for head_dim, theta, factor, original in [(16, 10_000.0, 2.0, 256), (64, 10_000.0, 8.0, 4096),
                                              (128, 1_000_000.0, 4.0, 32_768), (96, 500_000.0, 3.5, 8192),
                                              (128, 10_000.0, 16.0, 2048)]:
        out = submission.call("yarn_inv_freq", head_dim, theta, factor, original)
        want, _ = hf_yarn(head_dim, theta, factor, original)
        submission.expect_close(out, want.double(), dtype=torch.float32, tol=1e-5,
                                name=f"yarn_inv_freq({head_dim}, {theta:g}, {factor}, {original})")


def test_yarn_attention_factor_matches_hugging_face(submission):
    """Factors 1.5 to 40: HF's attention_factor for yarn."""
    for factor in (1.5, 2.0, 8.0, 40.0):
        got = submission.call("yarn_attention_factor", factor)
        _, want = hf_yarn(64, 10_000.0, factor, 1024)
        assert isinstance(got, float) and abs(got - want) < 1e-9, \
            f"yarn_attention_factor({factor}) should be {want:.6f}, got {got!r}"
