"""`hf_import.load_tokenizer` takes the class `tokenizer_config.json` names instead of asking
`AutoTokenizer`: the same class and the same ids, without importing PyTorch."""

import json
import subprocess
import sys

import pytest
import transformers
from helpers import tiny_modernbert_folder

from isojax.models import hf_import

TEXTS = [("A man is playing a guitar.", "Someone plays music!"), ("ISOJAX, naïve café", None)]


def _bert_with_slow_name(folder, minilm_dir):
    """MiniLM's vocabulary saved as a slow `BertTokenizer` would name itself."""
    transformers.BertTokenizerFast.from_pretrained(str(minilm_dir)).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "BertTokenizer"})
    )
    return folder


def _vocab_only(folder, minilm_dir):
    """A folder with only `vocab.txt`: no `tokenizer_config.json`, so `AutoTokenizer` decides."""
    (folder / "vocab.txt").write_text((minilm_dir / "vocab.txt").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return folder


@pytest.mark.parametrize("make", ["minilm", "slow-name", "modernbert", "vocab-only"])
def test_the_class_and_ids_are_autotokenizers(make, tmp_path, minilm_dir, glue_dir):
    folder = {
        "minilm": lambda: minilm_dir,
        "slow-name": lambda: _bert_with_slow_name(tmp_path, minilm_dir),
        "modernbert": lambda: tiny_modernbert_folder(tmp_path, glue_dir),
        "vocab-only": lambda: _vocab_only(tmp_path, minilm_dir),
    }[make]()
    ours = hf_import.load_tokenizer(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    for a, b in TEXTS:
        assert ours(a, b)["input_ids"] == auto(a, b)["input_ids"]
        assert ours(a, b).get("token_type_ids") == auto(a, b).get("token_type_ids")


def test_loading_minilms_tokenizer_imports_no_pytorch(minilm_dir):
    code = (
        "import sys, pathlib; from isojax.models import hf_import; "
        f"t = hf_import.load_tokenizer(pathlib.Path({str(minilm_dir)!r})); "
        "print(type(t).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["BertTokenizer", "False"]
