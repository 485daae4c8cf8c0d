"""train.models: preset shapes, validation, and building the tiny GPTModel in one gloo process."""
import pytest
import torch

from storage.config import ConfigError, from_dict
from train.models import PRESETS, ModelConfig, num_parameters

# Published parameter counts (HF model cards / config.json shapes), tied embeddings.
PUBLISHED = {"135m": 134_515_008, "360m": 361_821_120, "1.7b": 1_711_376_384, "3b": 3_075_098_624}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts(preset):
    assert num_parameters(ModelConfig(preset=preset))["total"] == PUBLISHED[preset]


def test_smollm_shapes():
    assert PRESETS["1.7b"]["num_kv_heads"] == PRESETS["1.7b"]["num_heads"] == 32
    s = ModelConfig(preset="3b").resolved()
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_hidden_size, s.vocab_size) == \
        (2048, 36, 16, 4, 11008, 128256)


def test_overrides_and_padding():
    m = from_dict(ModelConfig, {"preset": "135m", "vocab_size": 50000, "rope_theta": 1e6})
    r = m.resolved()
    assert (r.vocab_size, r.rope_theta, r.hidden_size) == (50000, 1e6, 576)
    assert m.padded_vocab_size(1) == 50048 and m.padded_vocab_size(2) % 256 == 0


@pytest.mark.parametrize("data,key", [
    ({"preset": "7b"}, "model.preset"),
    ({"num_heads": 5}, "model.num_heads"),
    ({"num_kv_heads": 3}, "model.num_kv_heads"),
    ({"hidden_sise": 64}, "hidden_sise"),
    ({"hidden_size": "big"}, "hidden_size"),
])
def test_bad_model_config_names_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_dict(ModelConfig, data)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from train import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    cpu_compat.uninstall()


def test_build_tiny_matches_param_count_and_is_deterministic(one_rank):
    from train.models import build_model

    cfg = ModelConfig(preset="tiny")
    (m1,) = build_model(cfg, seed=3)
    (m2,) = build_model(cfg, seed=3)
    (m3,) = build_model(cfg, seed=4)
    assert sum(p.numel() for p in m1.parameters()) == num_parameters(cfg)["total"]
    w1, w2, w3 = (dict(m.named_parameters()) for m in (m1, m2, m3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["embedding.word_embeddings.weight"], w3["embedding.word_embeddings.weight"])
    assert torch.all(w1["decoder.final_layernorm.weight"] == 1)
    cfg_m = m1.config
    assert (cfg_m.num_query_groups, cfg_m.gated_linear_unit, cfg_m.add_bias_linear) == (2, True, False)
    tok = torch.randint(0, 1024, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    loss = m1(tok, pos, None, labels=torch.randint(0, 1024, (2, 16)))
    assert loss.shape == (2, 16) and 6.0 < loss.mean().item() < 8.0  # ~ln(1024) at init


def test_tp_slice_keeps_gate_and_up_halves():
    from train.models import _tp_slice

    full = torch.arange(8).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    assert _tp_slice(full, 0, 2, 0, gated=True).flatten().tolist() == [0, 1, 4, 5]
    assert _tp_slice(full, 0, 2, 1, gated=True).flatten().tolist() == [2, 3, 6, 7]
    assert _tp_slice(full, 0, 2, 1, gated=False).flatten().tolist() == [4, 5, 6, 7]
