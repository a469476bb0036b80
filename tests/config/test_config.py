"""TrainConfig: real defaults, YAML + overrides, and an error naming the culprit for every kind of mistake."""

from __future__ import annotations

import json

import pytest

from trainer import ConfigError, TrainConfig

from conftest import JOBS, ROOT, job_exits, python, split_jobs


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_yaml_lists_only_what_differs(tmp_path):
    config = TrainConfig.from_yaml(write(tmp_path, "lr: 1e-3\nbatch_size: 16\nbetas: [0.9, 0.95]\n"))
    assert config.lr == 0.001 and config.batch_size == 16 and config.betas == (0.9, 0.95)
    assert config.epochs == TrainConfig().epochs and config.optimizer == "adamw"


def test_overrides_win_over_the_file(tmp_path):
    path = write(tmp_path, "lr: 0.1\nmax_steps: 5\n")
    config = TrainConfig.from_yaml(path, overrides=["lr=1e-3", "max_steps=null", "shuffle=false"])
    assert config.lr == 0.001 and config.max_steps is None and config.shuffle is False


@pytest.mark.parametrize(
    "text, culprit",
    [
        ("learning_rate: 0.1\n", "unknown key 'learning_rate'"),
        ("zzz: 1\n", "unknown key 'zzz'. The keys are TrainConfig's fields: help(trainer.TrainConfig)."),
        ("batchsize: 4\n", "Did you mean: batch_size"),
        ("lerning_rate: 0.1\n", "Did you mean: lr?"),  # transformers' name, misspelt: ours
        ("max_step: 3\n", "Did you mean: max_steps?"),  # the closest alone, not save_every and eval_every too
        ("batch_size: 0\n", "batch_size must be >= 1"),
        ("batch_size: 2.5\n", "batch_size must be int"),
        ("batch_size: '8'\n", "batch_size must be int"),
        ("lr: -1\n", "lr must be >= 0"),
        ("lr: fast\n", "lr must be float"),
        ("optimizer: adagrad\n", "optimizer must be one of sgd, adam, adamw, muon; got 'adagrad'"),
        ("lr_scheduler: step\n", "lr_scheduler must be one of"),
        ("nan_policy: ignore\n", "nan_policy must be one of raise, skip"),
        ("save_every: 0\n", "save_every must be >= 1"),
        ("resume: ''\n", "resume must be null, 'auto' or a checkpoint path"),
        ("shuffle: 1\n", "shuffle must be bool"),
        ("betas: [0.9]\n", "betas must be"),
        ("betas: [0.9, 1.5]\n", "betas must both be in [0, 1)"),
        ("momentum: 1.0\n", "momentum must be in [0, 1)"),
        ("max_grad_norm: 0\n", "max_grad_norm must be > 0"),
        ("gradient_accumulation_steps: 0\n", "gradient_accumulation_steps must be >= 1"),
        ("max_steps: 0\n", "max_steps must be >= 1"),
        ("epochs: null\n", "epochs must be int"),
        ("- lr\n", "expected a mapping"),
        ("lr: [\n", "not valid YAML"),
        ("lr: .nan\n", "lr must be a finite number, got nan"),  # torch would refuse it only at the optimizer
        ("lr: .inf\n", "lr must be a finite number, got inf"),  # or train to a misleading NaN loss
        ("max_grad_norm: .inf\n", "max_grad_norm must be a finite number"),
        ("lr: 0.001\nbatch_size: 4\nlr: 5\n", "key 'lr' is given twice (lines 1 and 3)"),  # PyYAML keeps the last
        ("", "is empty: list the TrainConfig keys"),
        ("# all defaults\n", "is empty"),
        ("preemption_signals: SIGTERM,SIGFOO\n", "'SIGFOO' is not a signal name"),
        ("keep_best: eval_loss\n", "keep_best is 'eval_loss', but eval_every is None and save_every None"),
        ("keep_best: eval_loss\neval_every: 100\nsave_every: 30\n", "Set eval_every to a multiple of save_every"),
        ("load_best_at_end: true\n", "load_best_at_end needs keep_best"),
    ],
)
def test_bad_yaml_names_the_culprit(tmp_path, text, culprit):
    """Each message names the file too (``lr: fast`` did not), and is one short line: the closest keys, not all
    53 of them (900 characters before)."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=None) as err:
        TrainConfig.from_yaml(path)
    assert culprit in str(err.value) and str(err.value).startswith(str(path)), str(err.value)
    assert len(str(err.value)) < 300 + len(str(path)) and "\n" not in str(err.value), str(err.value)


def test_bad_override_names_the_override_not_the_file(tmp_path):
    """``overrides=["lr=abc"]`` blamed the YAML file before ("run.yaml: lr must be float")."""
    path = write(tmp_path, "seed: 0\n")
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml(path, overrides=["lrr=0.1"])
    assert str(err.value) == "override 'lrr=0.1': unknown key 'lrr'. Did you mean: lr?"
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_yaml(path, overrides=["seed=1", "lr=abc"])
    assert str(err.value) == "override 'lr=abc': lr must be float, got 'abc' (str)"
    with pytest.raises(ConfigError, match="not of the form key=value"):
        TrainConfig.from_yaml(path, overrides=["lr"])
    with pytest.raises(ConfigError, match=f"^{path}: unknown key 'zzz'"):
        TrainConfig.from_yaml(write(tmp_path, "zzz: 1\n"), overrides=["lr=0.1"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        TrainConfig.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder: pass a YAML file"):
        TrainConfig.from_yaml(tmp_path)


def test_constructor_validates_too():
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="lr must be float"):
        TrainConfig(lr="fast")
    with pytest.raises(ConfigError, match="warmup_steps must be >= 0"):
        TrainConfig().replace(warmup_steps=-1)


def test_a_path_is_taken_where_a_string_is_expected(tmp_path):
    """trainer.best_checkpoint and last_checkpoint are Paths: resume= takes one as it is, as output_dir does."""
    config = TrainConfig(output_dir=tmp_path / "run", resume=tmp_path / "run" / "checkpoints" / "step-00000004")
    assert config.output_dir == str(tmp_path / "run") and config.resume.endswith("step-00000004")
    with pytest.raises(ConfigError, match="resume must be str, got 4"):
        TrainConfig(resume=4)


def test_profile_steps_is_a_step_or_a_range():
    assert TrainConfig(profile_steps="10-12").profile_steps == "10-12" and TrainConfig(profile_steps="3")
    for bad in ("12-10", "0", "ten", "10-"):
        with pytest.raises(
            ConfigError,
            match=f"profile_steps must be an optimizer step or a range of them, say "
            f"'10-12' \\(or null for no trace\\); got '{bad}'",
        ):
            TrainConfig(profile_steps=bad)


def test_wandb_project_is_a_name_or_null():
    assert TrainConfig(wandb_project="p").wandb_project == "p"
    with pytest.raises(ConfigError, match="wandb_project must be a wandb project name"):
        TrainConfig(wandb_project="")


def test_the_constructor_suggests_the_closest_field_as_the_yaml_path_does():
    with pytest.raises(ConfigError, match="TrainConfig: unknown key 'batchsize'. Did you mean: batch_size"):
        TrainConfig(batchsize=3)


@pytest.mark.parametrize(
    "key,file",
    [
        ("mixed_precision", "bf16.yaml or fp16.yaml"),
        ("bf16", "bf16.yaml"),
        ("fp16", "fp16.yaml"),
        ("fsdp", "fsdp.yaml"),
        ("deepspeed", "fsdp.yaml"),
    ],
)
def test_a_setting_of_the_accelerate_config_names_the_file_that_sets_it(key, file, tmp_path):
    """transformers' TrainingArguments take these; here the accelerate config at launch does, for every process."""
    with pytest.raises(
        ConfigError,
        match=f"'{key}' is not a TrainConfig key: the accelerate config chosen at "
        f"launch sets it.*accelerate_configs/{file}",
    ):
        TrainConfig(**{key: True})
    (tmp_path / "run.yaml").write_text(f"{key}: true\n")
    with pytest.raises(ConfigError, match=f"run.yaml: '{key}' is not a TrainConfig key"):
        TrainConfig.from_yaml(tmp_path / "run.yaml")


def test_the_main_jobs_config_mistakes_are_one_line_naming_the_file(tmp_path):
    """``python examples/gpt2.py --config run.yaml`` with a misspelt key, a wrong value and a bucket's URL as
    output_dir (three runs in one process, tests/jobs/run_many.py): one ``trainer:`` line each naming the file, exit
    1."""
    texts = {"misspelt": "batchsize: 4\n", "wrong value": "lr: fast\n", "a URL": "output_dir: s3://bucket/run\n"}
    files = {name: tmp_path / f"{i}.yaml" for i, name in enumerate(texts)}
    for name, text in texts.items():
        files[name].write_text(text)
    jobs = [[str(ROOT / "examples" / "gpt2.py"), "--config", str(path)] for path in files.values()]
    result = python(JOBS, json.dumps(jobs), expect_ok=False)
    assert job_exits(result.stderr, 3) == [1, 1, 1], result.stderr
    said = [[line for line in out.splitlines() if line.startswith("trainer: ")] for out in split_jobs(result.stderr)]
    assert said == [
        [f"trainer: {files['misspelt']}: unknown key 'batchsize'. Did you mean: batch_size?"],
        [f"trainer: {files['wrong value']}: lr must be float, got 'fast' (str)"],
        # A bucket as output_dir made a local folder named "s3:" before, and no checkpoint reached the bucket.
        [
            f"trainer: {files['a URL']}: output_dir is a URL (s3://bucket/run); it is a local folder (logs, the lock, "
            "final/): keep the checkpoints in a bucket with checkpoint_storage: s3://bucket/run, and a local output_dir"
        ],
    ], result.stderr
