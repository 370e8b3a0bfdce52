import pytest
import torch

from helpers.system.device import (
    REFERENCE_DEVICES,
    UnsupportedDtypeError,
    autocast_dtype,
    check_dtype,
    detect_capabilities,
    needs_grad_scaler,
)
from helpers.system.scale import by_scale, current_scale, scale_for, smoke_requested

EXPECTED = {  # device -> (autocast dtype, needs GradScaler, scale)
    "cpu": (torch.bfloat16, False, "cpu"),
    "cpu-no-bf16": (None, False, "cpu"),
    "mps": (torch.bfloat16, False, "cpu"),
    "t4": (torch.float16, True, "gpu"),
    "a100": (torch.bfloat16, False, "gpu"),
    "h100": (torch.bfloat16, False, "gpu"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_decisions_per_device(name):
    caps = REFERENCE_DEVICES[name]
    dtype, scaler, scale = EXPECTED[name]
    assert autocast_dtype(caps) == dtype
    assert needs_grad_scaler(autocast_dtype(caps)) == scaler
    assert scale_for(caps.device_type, smoke=False) == scale
    assert scale_for(caps.device_type, smoke=True) == "smoke"


def test_bf16_on_a_t4_is_refused_with_the_fix():
    with pytest.raises(UnsupportedDtypeError, match="use torch.float16 with torch.amp.GradScaler"):
        check_dtype(REFERENCE_DEVICES["t4"], torch.bfloat16)
    assert check_dtype(REFERENCE_DEVICES["a100"], torch.bfloat16) == torch.bfloat16


def test_detected_cpu_record_matches_torch():
    caps = detect_capabilities("cpu")
    assert caps.device_type == "cpu" and caps.cpu_threads == torch.get_num_threads()
    assert detect_capabilities("cpu:0") == detect_capabilities(torch.device("cpu")) == caps  # a device, indexed or not
    if caps.bf16_native:  # autocast must then actually produce bf16 on this CPU
        with torch.autocast("cpu", dtype=autocast_dtype(caps)):
            assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == torch.bfloat16


def test_missing_devices_are_clear_errors():
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
            detect_capabilities("cuda")
    for unknown in ("tpu", "meta"):  # not a device torch knows; one it knows without a capabilities record
        with pytest.raises(ValueError, match="valid: cuda, mps, cpu"):
            detect_capabilities(unknown)


def test_smoke_switch(monkeypatch):
    assert smoke_requested({"COURSE_SMOKE": "1"}) and not smoke_requested({})
    assert not smoke_requested({"COURSE_SMOKE": "0"})
    with pytest.raises(ValueError, match="set it to 1"):
        smoke_requested({"COURSE_SMOKE": "maybe"})
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert current_scale("cuda") == "smoke"
    assert by_scale("smoke", smoke=1, cpu=2, gpu=3) == 1
    with pytest.raises(ValueError, match="valid scales"):
        by_scale("huge", smoke=1, cpu=2, gpu=3)
