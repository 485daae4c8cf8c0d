"""train.model.cpu_compat: CUDA→CPU mapping, type strings, stubs, the CPU RNG tracker's seed offsets, and
suspending the mode for a block."""
import pytest
import torch

from train.model import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="cpu_compat is a no-op when CUDA is present")


@pytest.fixture
def compat():
    assert cpu_compat.install() is True
    yield cpu_compat
    cpu_compat.uninstall()


def test_install_is_idempotent_and_reversible():
    assert not cpu_compat.active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    assert cpu_compat.install() and cpu_compat.install()
    assert cpu_compat.active()
    assert torch.empty(1, device="cuda").device.type == "cpu"
    cpu_compat.uninstall()
    assert not cpu_compat.active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")


def test_suspended_turns_the_mode_off_for_a_block_and_back_on(compat):
    """Generation in a trainer's process runs inside `suspended()`: no CUDA mapping (and no per-op Python
    call) there, the mode back on after, and a no-op where the mode is not on."""
    assert torch.empty(1, device="cuda").device.type == "cpu"
    with compat.suspended():
        assert not torch.overrides._get_current_function_mode_stack()
        with pytest.raises((RuntimeError, AssertionError)):
            torch.empty(1, device="cuda")
    assert compat.active() and torch.empty(1, device="cuda").device.type == "cpu"
    compat.uninstall()
    with compat.suspended():  # nothing to suspend
        assert not torch.overrides._get_current_function_mode_stack()
    compat.install()


def test_cuda_devices_map_to_cpu(compat):
    assert torch.zeros(2, device="cuda:0").device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"  # bare int ordinal
    assert torch.tensor([1, 2], device=torch.device("cuda")).device.type == "cpu"
    t = torch.arange(3.0)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(torch.cuda.current_device()).device.type == "cpu"
    assert t.to("cuda", dtype=torch.float64).dtype == torch.float64
    assert t.new_zeros(2, device="cuda").device.type == "cpu"


def test_type_strings_and_stubs(compat):
    t = torch.zeros(2)
    assert t.type() == "torch.cuda.FloatTensor"
    assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type("torch.cuda.HalfTensor").dtype == torch.float16
    assert t.type(torch.float64).dtype == torch.float64
    assert torch.cuda.current_device() == 0
    assert torch.cuda.device_count() == 1  # rank % device_count() must not divide by zero
    torch.cuda.synchronize()
    torch.cuda.set_device(0)


def _draw(tracker, name, n=4):
    with tracker.fork(name):
        return torch.rand(n)


def test_rng_tracker_offsets_match_megatron(compat):
    from megatron.core.tensor_parallel import random as mrandom

    seed = 1234
    draws = {}
    for tp_rank in (0, 1):
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        tracker = mrandom.get_cuda_rng_tracker()
        assert isinstance(tracker, cpu_compat.CPURNGStatesTracker)
        torch.manual_seed(7)
        before = torch.get_rng_state()
        draws[tp_rank] = _draw(tracker, "model-parallel-rng")
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
        # Megatron's offset: model-parallel stream seeded with seed + 2718 + tp_rank.
        expect = torch.rand(4, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank))
        assert torch.equal(draws[tp_rank], expect)
        # The stream advances across forks instead of replaying.
        assert not torch.equal(_draw(tracker, "model-parallel-rng"), draws[tp_rank])
        dp = _draw(tracker, "data-parallel-rng")
        assert torch.equal(dp, torch.rand(4, generator=torch.Generator().manual_seed(seed)))
    assert not torch.equal(draws[0], draws[1]), "TP ranks must draw different model-parallel numbers"


def test_rng_tracker_nested_fork_and_states(compat):
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = mrandom.get_cuda_rng_tracker()
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(2)
        with tracker.fork("data-parallel-rng"):
            torch.rand(2)
        b = torch.rand(2)
    tracker.set_states(saved)
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(2), a)
        assert torch.equal(torch.rand(2), b), "inner fork must not disturb the outer stream"
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 5)
