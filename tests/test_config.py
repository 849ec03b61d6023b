"""TrainConfig: presets as the issue states them (nanoGPT's recipes), typed --field=value
overrides, errors that name the field, JSON round trip, and errors raised before any spawn."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from course_lib.launch.training import build_config, cli
from course_lib.registry import STRATEGY_NAMES, ConfigError
from course_lib.trainer.config import TRAIN_PRESETS, TrainConfig, make_config, parse_overrides


def test_presets_are_nanogpts_recipes():
    # nanoGPT config/train_shakespeare_char.py
    gpu = make_config("shakespeare_char")
    assert (gpu.n_layer, gpu.n_head, gpu.n_embd, gpu.block_size, gpu.batch_size) == (6, 6, 384, 256, 64)
    assert (gpu.dropout, gpu.learning_rate, gpu.max_iters, gpu.lr_decay_iters) == (0.2, 1e-3, 5000, 5000)
    assert (gpu.min_lr, gpu.beta2, gpu.warmup_iters, gpu.eval_interval, gpu.eval_iters) == (1e-4, 0.99, 100, 250, 200)
    assert gpu.bias is False and gpu.gradient_accumulation_steps == 1 and gpu.dataset == "shakespeare_char"
    # nanoGPT README's CPU run of the same recipe
    cpu = make_config("shakespeare_char_cpu")
    assert (cpu.n_layer, cpu.n_head, cpu.n_embd, cpu.block_size, cpu.batch_size) == (4, 4, 128, 64, 12)
    assert (cpu.dropout, cpu.max_iters, cpu.lr_decay_iters, cpu.eval_iters) == (0.0, 2000, 2000, 20)
    assert (cpu.learning_rate, cpu.min_lr, cpu.beta2, cpu.warmup_iters) == (1e-3, 1e-4, 0.99, 100)
    assert set(TRAIN_PRESETS) == {"shakespeare_char", "shakespeare_char_cpu", "shakespeare_char_moe_cpu"}  # + experts (test_moe)


def test_overrides_are_typed():
    o = parse_overrides(["--max_iters=500", "--learning_rate=3e-4", "--compile", "--bias=false",
                         "--dataset", "shakespeare", "--nproc=3", "--dropout=0"])
    assert o == {"max_iters": 500, "learning_rate": 3e-4, "compile": True, "bias": False,
                 "dataset": "shakespeare", "nproc": 3, "dropout": 0.0}
    assert type(o["dropout"]) is float
    cfg = make_config("shakespeare_char_cpu", o)
    assert cfg.max_iters == 500 and cfg.n_layer == 4  # preset, then overrides
    assert parse_overrides(["--nproc=auto"])["nproc"] >= 1


@pytest.mark.parametrize("args, message", [
    (["--max_iters=abc"], "--max_iters: expected an integer, got 'abc'"),
    (["--max_iters=1.5"], "--max_iters: expected an integer"),
    (["--learning_rate=fast"], "--learning_rate: expected a number"),
    (["--compile=maybe"], "--compile: expected true or false"),
    (["--n_layers=4"], r"unknown option --n_layers \(did you mean --n_layer\?\)"),
    (["--max_iters"], "--max_iters needs a value"),
    (["max_iters=3"], "expected --field=value"),
])
def test_bad_overrides_name_the_field(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_overrides(args)


@pytest.mark.parametrize("changes, message", [
    ({"n_embd": 130, "n_head": 4}, r"n_embd \(130\) must be divisible by n_head \(4\)"),
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"dropout": 1.0}, "dropout must be in"),
    ({"strategy": "horovod"}, "strategy must be one of"),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"device": "tpu"}, "device must be"),
    ({"strategy": "single", "nproc": 2}, "strategy 'single' runs one process"),
    ({"max_iters": "10"}, "max_iters: expected int, got str"),
    ({"compile": 1}, "compile: expected bool, got int"),
])
def test_invalid_values_are_rejected(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)


def test_make_config_names_a_misplaced_argument():
    """A dict where the preset's name goes, or overrides as text: once a TypeError (unhashable dict)
    and a ValueError from deep in dict.update."""
    with pytest.raises(ConfigError, match="the preset is a name such as 'shakespeare_char_cpu'"):
        make_config({"max_iters": 3})
    with pytest.raises(ConfigError, match=r"overrides must be a dict such as \{'max_iters': 100\}"):
        make_config("shakespeare_char_cpu", "max_iters=3")


def test_every_strategy_name_is_accepted_and_auto_resolves():
    for name in STRATEGY_NAMES:
        TrainConfig(strategy=name, nproc=1 if name == "single" else 2)
    assert TrainConfig().resolved_strategy(1) == "single"
    assert TrainConfig(nproc=2).resolved_strategy(2) == "ddp"  # ours is the default for nproc > 1


def test_the_dp_flavours_beside_tp_pp_cp_are_the_registrys():
    """One fact, one home (issue 30 item 3): the configuration allows beside tp/pp/cp exactly the
    strategies the registry marks so (before: gpt/layout.py said auto, ddp, zero1, zero2 and the
    registry single, ddp, zero1, zero2)."""
    from course_lib import registry

    allowed = set()
    for name in STRATEGY_NAMES + ("auto",):
        try:
            TrainConfig(strategy=name, nproc=2, tp=2)
            allowed.add(name)
        except ConfigError as e:
            assert "does not combine with tp/pp/cp" in str(e)
    assert allowed == {"auto", *registry.DP_FLAVOURS}


def test_every_field_has_a_docstring_and_help_prints_it(capsys):
    """Issue 30 item 1 (in part): each field of the configuration has a docstring, and the command
    line generated from the fields prints it."""
    from course_lib.registry import field_docs
    from course_lib.trainer.config import FIELDS

    docs = field_docs(TrainConfig)
    assert set(docs) == set(FIELDS), sorted(set(FIELDS) - set(docs))
    assert all(len(doc) > 5 for doc in docs.values())
    with pytest.raises(SystemExit):
        build_config(["--help"])
    assert docs["pp_schedule"] in " ".join(capsys.readouterr().out.split())


def test_configurations_are_owned_by_their_components():
    """Issue 30 item 1: model, data, optimizer, parallel layout and run each own their fields (a
    docstring each) and check them on their own; the parallel layout is torch-free and outside
    gpt/; TrainConfig is made of them, flat, and unknown keys stay errors."""
    import subprocess
    import sys

    from course_lib import registry
    from course_lib.registry import ParallelConfig, field_docs
    from course_lib.trainer.config import COMPONENTS, FIELDS, DataConfig, ModelConfig, OptimizerConfig, RunConfig

    owned = [f.name for cls in COMPONENTS.values() for f in dataclasses.fields(cls)]
    assert sorted(owned) == sorted(FIELDS) and len(owned) == len(set(owned))  # each field in one component
    assert ParallelConfig.__module__ == "course_lib.registry" and set(field_docs(ParallelConfig)) >= {"tp", "strategy"}
    # one configuration module, with the trainer that runs it, as torchtitan's job_config (issue 30: gpt/ knows
    # no strategy); each component owns its own fields
    assert {c.__module__ for c in (TrainConfig, ModelConfig, DataConfig, OptimizerConfig, RunConfig)} == {
        "course_lib.trainer.config"}
    import course_lib.gpt
    assert not (Path(course_lib.gpt.__file__).parent / "config.py").exists()
    for cls, bad, message in [(ModelConfig, {"n_embd": 30, "n_head": 4}, "divisible by n_head"),
                              (DataConfig, {"dataset": "owt"}, "dataset must be one of"),
                              (OptimizerConfig, {"beta2": 1.0}, r"beta2 must be in \[0, 1\)"),
                              (RunConfig, {"device": "tpu"}, "device must be"),
                              (ParallelConfig, {"tp": 2, "strategy": "fsdp_full"}, "does not combine with tp/pp/cp")]:
        with pytest.raises(ConfigError, match=message):
            cls(**bad)
        with pytest.raises(ConfigError, match=message):  # the same check, run by the whole
            TrainConfig(**bad)
    cfg = TrainConfig(n_layer=2, tp=2, nproc=2, learning_rate=3e-4)
    assert (cfg.model.n_layer, cfg.parallel.tp, cfg.optimizer.learning_rate) == (2, 2, 3e-4)
    assert cfg.parallel == ParallelConfig(nproc=2, tp=2) and cfg.run == RunConfig()
    with pytest.raises(ConfigError, match="unknown field"):
        TrainConfig.from_dict({**cfg.to_dict(), "n_layers": 3})
    code = "import sys, course_lib.registry as r; r.ParallelConfig(tp=2); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert registry.ParallelConfig(nproc=3).resolved_strategy(3) == "ddp"


def test_frozen_and_json_round_trip(tmp_path):
    cfg = make_config("shakespeare_char", {"nproc": 2, "out_dir": str(tmp_path)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_iters = 1
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert TrainConfig.load(path) == cfg
    d = json.loads(cfg.to_json())
    d["learning_rate"] = 1  # JSON may write a float as an int
    assert TrainConfig.from_dict(d).learning_rate == 1.0
    with pytest.raises(ConfigError, match="unknown field.*wandb_log"):
        TrainConfig.from_json(json.dumps({**d, "wandb_log": True}))
    with pytest.raises(ConfigError, match="n_layer: expected int, got str"):
        TrainConfig.from_json(json.dumps({**d, "n_layer": "6"}))
    with pytest.raises(ConfigError, match="not valid JSON"):
        TrainConfig.from_json("{")
    with pytest.raises(ConfigError, match="cannot read config file"):
        TrainConfig.load(tmp_path / "missing.json")


def test_build_config_from_preset_file_and_resume(tmp_path):
    cfg, _ = build_config(["--config=shakespeare_char_cpu", "--max_iters=7", f"--out_dir={tmp_path}"])
    assert cfg.max_iters == 7 and cfg.n_embd == 128
    (tmp_path / "config.json").write_text(cfg.to_json())
    same, _ = build_config(["--config-file", str(tmp_path / "config.json")])
    assert same == cfg
    resumed, _ = build_config(["--resume", f"--out_dir={tmp_path}", "--max_iters=9"])
    assert resumed == cfg.replace(init_from="resume", max_iters=9)  # the run's own config + overrides
    with pytest.raises(ConfigError, match="--resume needs --out_dir"):
        build_config(["--resume"])
    with pytest.raises(ConfigError, match="unknown --config 'gpt2'"):
        build_config(["--config=gpt2"])


def test_cli_reports_bad_input_before_spawning(tmp_path, capsys):
    assert cli(["--max_iters=abc"]) == 2
    assert "course train: error: --max_iters: expected an integer" in capsys.readouterr().err
    # data not prepared: the message says how to prepare it, and no worker was started
    assert cli([f"--data_dir={tmp_path}", "--nproc=2", f"--out_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert f"run: course data prepare shakespeare_char --data-dir {tmp_path}" in err
    assert not (tmp_path / "run").exists()
