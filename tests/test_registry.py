"""The torch-free registry of strategies is what every reader uses, and it names real classes."""

from __future__ import annotations

import importlib
import subprocess
import sys

from course_lib import registry
from course_lib.trainer import config


def test_registry_is_torch_free():
    code = "import sys, course_lib.registry as r; assert r.STRATEGY_NAMES; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_every_reader_takes_its_names_from_the_registry():
    assert registry.STRATEGY_NAMES == tuple(registry.STRATEGIES)
    assert registry.GRAD_COMM_STRATEGIES == ("ddp", "ddp_naive", "torch_ddp")  # whole-gradient all-reduce
    assert config.FIELDS["strategy"].default == "auto" and not hasattr(config, "STRATEGY_NAMES")  # no second name
    assert registry.DP_FLAVOURS == ("single", "ddp", "zero1", "zero2", "zero3")
    for name, info in registry.STRATEGIES.items():
        module, cls = info.cls.split(":")
        assert getattr(importlib.import_module(module), cls).name == name, name  # a real class, rightly named
    rows = {r["strategy"]: r for r in registry.strategy_rows()}
    assert rows["zero3"]["ZeRO stage"] == 3 and rows["single"]["ZeRO stage"] == "-" and rows["ddp"]["with tp/pp/cp"] == "yes"
