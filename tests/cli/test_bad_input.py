"""`isojax finetune` on bad input, as a user meets it: one line on stderr naming the file and
line, the key or the size, exit status 2, and nothing trained (issue 25, items 9 to 11).

Each case stops before the train state is built: tiny-bert over MiniLM's tokenizer (or MiniLM's
config alone), a few synthetic rows, no compilation.
"""

import json
import shutil

import jax
import pytest
from helpers import finetune_args, one_line

from isojax import cli
from isojax.linen import norms
from isojax.training import build, specs

RTE_HEADER = "index\tsentence1\tsentence2\tlabel"
STSB_HEADER = (
    "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
)


def _rte_rows(n):
    labels = ("entailment", "not_entailment")
    return [f"{i}\tA man walks {i}.\tA person moves.\t{labels[i % 2]}" for i in range(n)]


def _stsb_rows(n):
    return [
        f"{i}\tg\tf\t2012\t{i}\ts\ts\tA dog runs {i}.\tAn animal moves.\t{i % 5}.0"
        for i in range(n)
    ]


def _glue_dir(tmp_path, task, train, dev):
    """`tmp_path/glue/<TASK>/{train,dev}.tsv` with the given texts."""
    folder = tmp_path / "glue" / {"rte": "RTE", "stsb": "STS-B"}[task]
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(train, encoding="utf-8")
    (folder / "dev.tsv").write_text(dev, encoding="utf-8")
    return folder.parent


def _finetune(capsys, tmp_path, minilm_dir, *extra, model="tiny-bert"):
    workdir = tmp_path / "run"
    argv = ["finetune", "--workdir", str(workdir), "--model", model]
    if model == "tiny-bert":
        argv += ["--set", f"tokenizer={minilm_dir}"]
    argv += ["--set", "progress=false", "--set", "tensorboard=false", *extra]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("isojax finetune: error: "), err
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()
    return err.strip()


def _text(header, rows):
    return "\n".join([header, *rows]) + "\n"


@pytest.mark.parametrize(
    "task, split, edit, message",
    [
        # A row with a field too few (a tab lost), then one too many.
        ("rte", "train", lambda rows: rows[:3] + ["3\tA man.\tentailment"] + rows[4:],
         "5: 3 tab-separated fields, expected 4"),
        ("rte", "dev", lambda rows: rows + ["9\ta\tb\tentailment\textra"],
         "10: 5 tab-separated fields, expected 4"),
        # A non-numeric STS-B score.
        ("stsb", "dev", lambda rows: rows[:1] + [rows[1].rsplit("\t", 1)[0] + "\tfour"] + rows[2:],
         "3: 'score' is 'four', not a finite number"),
        # A blank line in the middle (a cut or merged file); one at the end is accepted.
        ("rte", "train", lambda rows: rows[:2] + [""] + rows[2:],
         "4: blank line before line 5"),
    ],
)  # fmt: skip
def test_malformed_tsv_is_one_line_naming_file_and_line(
    capsys, tmp_path, minilm_dir, task, split, edit, message
):
    rows = {"rte": _rte_rows, "stsb": _stsb_rows}[task](8)
    header = {"rte": RTE_HEADER, "stsb": STSB_HEADER}[task]
    texts = {"train": _text(header, rows), "dev": _text(header, rows)}
    texts[split] = _text(header, edit(rows))
    data = _glue_dir(tmp_path, task, texts["train"], texts["dev"])
    err = _finetune(capsys, tmp_path, minilm_dir, "--task", task, "--data-dir", str(data))
    folder = data / {"rte": "RTE", "stsb": "STS-B"}[task]
    assert f"{folder / split}.tsv:{message}" in err, err


def _model_folder(tmp_path, minilm_dir, **changes):
    """A copy of MiniLM's config.json (and tokenizer), with `changes`, without weights."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        if (minilm_dir / name).is_file():
            shutil.copy(minilm_dir / name, folder / name)
    hf = json.loads((minilm_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **changes}))
    return folder


@pytest.mark.parametrize(
    "changes, message",
    [
        ({}, "no weights found (looked for model.safetensors"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer in [1, 512], got 0"),
        ({"num_hidden_layers": 3000}, "num_hidden_layers must be an integer in [1, 128], got 3000"),
        ({"hidden_size": 10**9}, "hidden_size must be an integer in [1, 32768]"),
    ],
)
def test_bad_model_folder_is_one_line_before_tracing(
    capsys, tmp_path, minilm_dir, monkeypatch, changes, message
):
    """No weights, zero heads, 3000 layers (traced for 57 s before failing), hidden 10^9."""
    folder = _model_folder(tmp_path, minilm_dir, **changes)

    def traced(*args, **kwargs):
        raise AssertionError("the encoder was traced")

    monkeypatch.setattr(jax, "eval_shape", traced)
    err = _finetune(capsys, tmp_path, minilm_dir, model=str(folder))
    assert message in err and str(folder) in err, err


def test_no_such_model_is_one_line(capsys, tmp_path, minilm_dir):
    err = _finetune(capsys, tmp_path, minilm_dir, model=str(tmp_path / "no-such-model"))
    assert "neither a model folder nor an installed weights package" in err


def test_batch_larger_than_the_data_is_one_line(capsys, tmp_path, minilm_dir):
    rows = _rte_rows(6)
    data = _glue_dir(tmp_path, "rte", _text(RTE_HEADER, rows), _text(RTE_HEADER, rows))
    argv = ["--data-dir", str(data), "--set", "batch_size=8", "--set", "eval_batch_size=8"]
    err = _finetune(capsys, tmp_path, minilm_dir, *argv)
    assert "config: batch_size 8 is larger than the 6 training examples" in err


def test_max_length_above_the_models_positions_is_one_line(capsys, tmp_path, minilm_dir):
    """MiniLM has 512 positions: 100000 failed only at the first training step."""
    err = _finetune(
        capsys, tmp_path, minilm_dir, "--set", "max_length=100000", model=str(minilm_dir)
    )
    assert "config: max_length 100000 exceeds the 512 positions of model" in err, err


def test_documented_normalizer_kwargs_reach_the_head(minilm_dir):
    """`--set normalizer_kwargs.epsilon=1e-5` (ARCHITECTURE.md) sets the normaliser's epsilon."""
    args = cli.build_parser().parse_args(
        ["finetune", "--workdir", "unused", "--model", "tiny-bert", "--normalizer", "layernorm"]
        + ["--set", f"tokenizer={minilm_dir}", "--set", "normalizer_kwargs.epsilon=1e-5"]
    )
    config = cli.finetune.finetune_config(args)
    assert config.normalizer_kwargs.to_dict() == {"epsilon": 1e-5}
    model, _, _, _ = build.build_model(specs.ModelSpec.of(config), num_labels=2)
    assert dict(model.normalizer_kwargs) == {"epsilon": 1e-5}
    assert norms.make_normalizer(model.normalizer, **model.normalizer_kwargs).epsilon == 1e-5


def test_cli_refuses_infinite_weight_decay_and_a_tokenizer_larger_than_the_vocabulary(
    capsys, tmp_path, glue_dir, minilm_dir
):
    from isojax import linen
    from isojax.models import config as model_config

    code = cli.main(
        finetune_args(glue_dir, minilm_dir, tmp_path / "a", "optimizer.weight_decay=1e999")
    )
    err = capsys.readouterr().err
    assert code == 2 and one_line(err) and "weight_decay must be a finite number" in err, err

    cfg = model_config.EncoderConfig.from_hf(
        dict(
            model_type="bert",
            vocab_size=1000,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=40,
        )
    )
    small = linen.export_pretrained(
        tmp_path / "small", cfg, linen.init_params(linen.Encoder(cfg), jax.random.key(0))
    )
    argv = finetune_args(glue_dir, minilm_dir, tmp_path / "b")
    argv[argv.index("tiny-bert")] = str(small)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and one_line(err), err
    assert "30522 token ids, more than model" in err and "vocab_size 1000" in err


# ---------------------------------------------------------------------------------------------
# Every command's refusals beside a run folder: one line on stderr, exit status 2, the folder
# byte for byte as it was (issue 50).
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def run_folder(tmp_path):
    """A run folder's own files as `train_and_evaluate` leaves them (no weights: each refusal
    comes before any restore or build)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "checkpoints" / "4" / "x.bin").write_bytes(b"\x00\x01")
    (run / "best_checkpoint").mkdir()
    (run / "config.json").write_text(json.dumps({"task": "rte", "normalizer": "whiten"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "epoch": 0, "split": "train"}\n')
    (run / "results.json").write_text("{}\n")
    return run


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def _data(tmp_path):
    """GLUE-style folders: RTE with 8 rows, RTE with a header-only dev, CoLA and STS-B with one
    dev row, RTE with a 700-word dev row."""
    roots = {}
    for name, dev in (("rte", 8), ("empty", 0), ("one", 1)):
        rows = _rte_rows(8)
        roots[name] = _glue_dir(tmp_path / name, "rte", _text(RTE_HEADER, rows),
                                _text(RTE_HEADER, rows[:dev]))  # fmt: skip
    roots["stsb1"] = _glue_dir(
        tmp_path / "stsb1", "stsb", _text(STSB_HEADER, _stsb_rows(8)),
        _text(STSB_HEADER, _stsb_rows(1)),
    )  # fmt: skip
    long_row = "0\t" + " ".join(["word"] * 700) + "\tA person.\tentailment"
    roots["long"] = _glue_dir(tmp_path / "long", "rte", _text(RTE_HEADER, _rte_rows(8)),
                              _text(RTE_HEADER, [long_row, *_rte_rows(3)[1:]]))  # fmt: skip
    cola = tmp_path / "cola" / "glue" / "CoLA"
    cola.mkdir(parents=True)
    (cola / "train.tsv").write_text("".join(f"s\t{i % 2}\t\tA cat {i} sat.\n" for i in range(8)))
    (cola / "dev.tsv").write_text("s\t1\t\tOne sentence.\n")
    roots["cola1"] = cola.parent
    return roots


TINY = ["--model", "tiny-bert", "--tokenizer", "{tok}", "--max-length", "32"]
REFUSALS = [
    # finetune (finding 2): every normalizer_kwargs value typed before the build.
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.momentum=abc"],
     "normalizer_kwargs: momentum must be a number finite in float32, got 'abc'"),
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.alpha=abc"],
     "normalizer_kwargs: alpha must be a number finite in float32, got 'abc'"),
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.group_size=5"],
     "group_size 5 does not divide the width 32 of whiten's input (the hidden size of model "
     "'tiny-bert')"),
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.group_size=16.0"],
     "group_size must be a positive integer or None, got 16.0"),
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.group_size=True"],
     "group_size must be a positive integer or None, got True"),
    ("finetune", ["--normalizer", "whiten", "--set", "normalizer_kwargs.keep_scale=maybe"],
     "keep_scale must be True or False, got 'maybe'"),
    ("finetune", ["--normalizer", "isobn", "--set", "normalizer_kwargs.debias=no"],
     "debias must be True or False, got 'no'"),
    ("finetune", ["--set", "max_length=100000", "--model", "{tok}"],
     "max_length 100000 exceeds the 512 positions"),
    # finetune (audit 6, findings 3, 4, 6, 11): iterations bounded (1e6 hung while tracing),
    # epsilon and beta finite and > 0 in float32, no key offered that is then refused.
    ("finetune", ["--normalizer", "iternorm", "--set", "normalizer_kwargs.iterations=1000000"],
     "normalizer_kwargs: iterations 1000000 > 6: more float32 Newton-Schulz steps"),
    ("finetune", ["--normalizer", "iternorm", "--set", "normalizer_kwargs.epsilon=1e300"],
     "normalizer_kwargs: epsilon must be a number finite in float32, got 1e+300"),
    ("finetune", ["--normalizer", "iternorm", "--set", "normalizer_kwargs.epsilon=1e-300"],
     "normalizer_kwargs: epsilon must be > 0 in float32, got 1e-300"),
    ("finetune", ["--normalizer", "isobn", "--set", "isobn.beta=1e300"],
     "isobn: beta must be a number finite in float32, got 1e+300"),
    ("finetune", ["--normalizer", "layernorm", "--set", "normalizer_kwargs.momentum=0.5"],
     "has no hyper-parameter(s) ['momentum']; it takes ['epsilon', 'use_bias', 'use_scale']"),
    ("finetune", ["--normalizer", "none", "--set", "normalizer_kwargs.momentum=0.5"],
     "normalizer 'none' has no hyper-parameter(s) ['momentum']; it takes []"),
    # analyze (finding 7).
    ("analyze", [*TINY, "--data-dir", "{rte}", "--out", "{run}/results.json"],
     "--out {run}/results.json is a file"),
    ("analyze", [*TINY, "--data-dir", "{rte}", "--posthoc", "whiten,abtt", "--out",
                 "{run}/config.json/report"], "lies under the file {run}/config.json"),
    ("analyze", [*TINY, "--data-dir", "{empty}", "--posthoc", "whiten", "--out", "{run}/a"],
     "rte dev: 0 row(s); the report needs at least 2 (pairs)"),
    ("analyze", [*TINY, "--data-dir", "{empty}", "--out", "{run}/a"], "rte dev: 0 row(s)"),
    ("analyze", [*TINY, "--data-dir", "{one}", "--out", "{run}/a"], "rte dev: 1 row(s)"),
    ("analyze", [*TINY, "--task", "cola", "--data-dir", "{cola1}"],
     "cola dev: 1 row(s); the report needs at least 2 (sentences)"),
    ("analyze", [*TINY, "--task", "stsb", "--data-dir", "{stsb1}", "--posthoc", "whiten"],
     "stsb dev: 1 row(s)"),
    ("analyze", ["--model", "{tok}", "--data-dir", "{long}", "--max-length", "1024"],
     "--max-length 1024 exceeds the 512 positions of model"),
    ("analyze", ["--run", "{run}", "--model", "x"], "--model contradicts --run"),
    # analyze (audit 6, finding 8a): an IndexError traceback in the pair encoding.
    ("analyze", [*TINY, "--data-dir", "{rte}", "--max-length", "2"],
     "--max-length must be >= 4, got 2"),
    ("analyze", [*TINY, "--data-dir", "{rte}", "--max-length", "1"],
     "--max-length must be >= 4, got 1"),
    # export, predict (destinations refused before the restore).
    ("export", ["{run}", "{run}/checkpoints/hf"], "own files"),
    ("export", ["{run}", "{run}/config.json/hf"], "is a file, not a folder"),
    ("predict", ["{run}", "--split", "dev", "--out", "{run}/metrics.jsonl"], "own files"),
    ("predict", ["{run}", "--split", "test", "--glue-submission", "{run}/best_checkpoint"],
     "own files"),
]  # fmt: skip


@pytest.mark.parametrize("command, argv, message", REFUSALS)
def test_every_commands_refusal_is_one_line_and_leaves_the_run_folder(
    capsys, monkeypatch, tmp_path, minilm_dir, run_folder, command, argv, message
):
    """Findings 2 and 7 of the turn-5 audit, and the table of refusals it held: `momentum=abc`
    was a TypeError traceback, `group_size=5` one after the model was built, 16.0 a shape
    error, True and 'maybe' accepted; `analyze --out FILE` a FileExistsError after the
    encoding, an empty dev split a ValueError, `--max-length 1024` one from the trace, one
    sentence or pair definite-looking numbers. Each is one line, exit status 2, before any
    weights are read, and the run folder is byte for byte as it was."""
    names = {"run": run_folder, "tok": minilm_dir, **_data(tmp_path)}
    argv = [a.format(**names) for a in argv]
    if command == "finetune":
        argv = ["--workdir", str(run_folder), "--model", "tiny-bert", "--task", "rte",
                "--set", f"tokenizer={minilm_dir}", "--set", "progress=false", *argv]  # fmt: skip
    monkeypatch.setattr(build, "load_encoder", _no_weights)
    before = _snapshot(run_folder)
    code = cli.main([command, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"isojax {command}: error: ") and message.format(**names) in err, err
    assert _snapshot(run_folder) == before


def _no_weights(*args, **kwargs):
    raise AssertionError("a weights file or encoder was loaded before the refusal")


def _hf_folder(root, minilm_dir, *, config=True, weights=True, card=None):
    """A Hugging Face model folder: MiniLM's config.json and tokenizer, stand-in weights."""
    root.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(minilm_dir / name, root / name)
    if config:
        shutil.copy(minilm_dir / "config.json", root / "config.json")
    if weights:
        (root / "model.safetensors").write_bytes(b"stand-in weights")
    if card is not None:
        (root / "README.md").write_text(card)
    return root


@pytest.mark.parametrize(
    "kind", ["hf", "weights only", "config only", "export", "unreadable config"]
)
def test_finetune_export_and_predict_never_write_over_a_model_folder(
    capsys, monkeypatch, tmp_path, minilm_dir, run_folder, kind
):
    """Audit 6, finding 2: `finetune --workdir DIR` wrote its config.json over the Hugging Face
    model in DIR (the `--model` folder itself, an `isojax export`), exit 0. Now `finetune`
    into a folder holding a foreign config.json or any weights, `export --overwrite` into one
    that no isojax export wrote, and `predict --out` / `--glue-submission` into one are each
    refused in one line, exit 2, and every file of the folder is byte-identical."""
    card = "# x\nExported by isojax 0.0 from the run `r`\n" if kind == "export" else None
    folder = _hf_folder(
        tmp_path / "model",
        minilm_dir,
        config=kind != "weights only",
        weights=kind != "config only",
        card=card,
    )
    if kind == "unreadable config":
        (folder / "config.json").write_bytes(b"\xff\xfe{")
    monkeypatch.setattr(build, "load_encoder", _no_weights)
    before = _snapshot(folder)
    commands = [
        ["finetune", "--task", "rte", "--model", "tiny-bert", "--workdir", str(folder),
         "--set", f"tokenizer={minilm_dir}", "--set", "progress=false"],
        ["predict", str(run_folder), "--split", "dev", "--out", str(folder / "p.tsv")],
        ["predict", str(run_folder), "--split", "test", "--glue-submission", str(folder)],
    ]  # fmt: skip
    if kind != "export":  # an earlier isojax export is what --overwrite replaces
        commands.append(["export", str(run_folder), str(folder), "--overwrite"])
    for argv in commands:
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and one_line(err), (argv, err)
        assert "holds a model" in err and str(folder) in err, err
        assert _snapshot(folder) == before, argv
