"""GLUE registry and sources: the real TSVs and broken files (the TFDS source: test_tfds.py)."""

import ast
import collections
import pathlib
import statistics

import pytest

from isojax.data import glue, tasks, tfds_source

# SOURCE.md of ../shared/data/glue: data rows and label counts (train, dev).
COUNTS = {
    "cola": ((8551, {1: 6023, 0: 2528}), (1043, {1: 721, 0: 322})),
    "mrpc": ((3668, {1: 2474, 0: 1194}), (408, {1: 279, 0: 129})),
    "rte": ((2490, {0: 1249, 1: 1241}), (277, {0: 146, 1: 131})),
}


@pytest.mark.parametrize("task", sorted(COUNTS))
@pytest.mark.parametrize("split", ["train", "dev"])
def test_row_counts_and_label_distribution(glue_dir, task, split):
    rows, labels = COUNTS[task][split == "dev"]
    examples = glue.load_tsv(glue_dir, task, split)
    assert len(examples) == rows
    assert dict(collections.Counter(e.label for e in examples)) == labels
    assert [e.idx for e in examples] == list(range(rows))
    assert all(isinstance(e.label, int) for e in examples)
    pair = tasks.get_task(task).is_pair
    assert all((e.text_b is not None) == pair and e.text_a for e in examples)


@pytest.mark.parametrize("split, rows, mean", [("train", 5749, 2.70), ("dev", 1500, 2.36)])
def test_stsb_scores(glue_dir, split, rows, mean):
    examples = glue.load_tsv(glue_dir, "stsb", split)
    scores = [e.label for e in examples]
    assert len(examples) == rows
    assert statistics.fmean(scores) == pytest.approx(mean, abs=0.005)
    assert min(scores) == 0.0 and max(scores) == 5.0
    first = {"train": "A plane is taking off.", "dev": "A man with a hard hat is dancing."}
    assert (examples[0].text_a, examples[0].label) == (first[split], 5.0)


def test_file_quirks(glue_dir):
    # MRPC: the BOM must not end up in the first column name or the first text.
    mrpc = glue.load_tsv(glue_dir, "mrpc", "dev")
    assert mrpc[0].text_a.startswith("He said the foodservice pie business")
    assert mrpc[0].text_b.startswith('" The foodservice pie')  # unbalanced quote kept
    assert mrpc[0].label == 1
    # CoLA: no header (row 0 is data), and the last dev line has no newline.
    cola = glue.load_tsv(glue_dir, "cola", "dev")
    assert cola[0] == tasks.Example("The sailors rode the breeze clear of the rocks.", None, 1, 0)
    assert cola[-1] == tasks.Example("John talked to Bill about himself.", None, 1, 1042)
    # RTE: entailment = 0 as in TFDS; fields with unbalanced quotes stay verbatim.
    rte = glue.load_tsv(glue_dir, "rte", "train")
    assert sum('"' in e.text_a + e.text_b for e in rte) > 0
    assert rte[0].label == 1  # "not_entailment"


def test_registry_is_complete():
    assert sorted(tasks.TASKS) == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]
    assert {t.name: t.num_labels for t in tasks.TASKS.values()} == {
        "cola": 2, "sst2": 2, "mrpc": 2, "stsb": 1, "qqp": 2, "mnli": 3, "qnli": 2, "rte": 2,
    }  # fmt: skip
    assert tasks.get_task("STS-B") is tasks.TASKS["stsb"] and tasks.TASKS["stsb"].is_regression
    mnli = tasks.get_task("mnli")
    assert mnli.splits == ("train", "dev_matched", "dev_mismatched")  # the labelled ones
    assert mnli.all_splits == (*mnli.splits, "test_matched", "test_mismatched")
    assert mnli.tfds_split("dev_mismatched") == "validation_mismatched"
    assert mnli.tfds_split("test_matched") == "test_matched"
    assert all(tasks.get_task(t).test_splits == ("test",) for t in tasks.TASKS if t != "mnli")
    assert tasks.get_task("rte").tfds_split("test") == "test"
    assert tasks.get_task("rte").tfds_split("dev") == "validation"
    assert glue.tsv_path("g", "mnli", "dev_matched").as_posix() == "g/MNLI/dev_matched.tsv"
    assert tasks.get_task("mrpc").metrics == ("f1", "accuracy")
    assert tasks.get_task("cola").metrics == ("matthews_correlation",)
    with pytest.raises(ValueError, match=r"no split 'dev'.*'dev_matched'"):
        glue.tsv_path("g", "mnli", "dev")


# The header rows of the standard GLUE files of the tasks not held locally.
STANDARD_FILES = {
    ("sst2", "dev"): (
        "sentence\tlabel",
        "it 's a charming journey . \t1",
        ("it 's a charming journey . ", None, 1),
    ),
    ("qqp", "dev"): (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
        "201359\t303345\t303346\tWhy are people?\tWhat is \"it?\t0",
        ("Why are people?", 'What is "it?', 0),
    ),
    ("qnli", "dev"): (
        "index\tquestion\tsentence\tlabel",
        "0\tWhat came into force?\tThe law came.\tnot_entailment",
        ("What came into force?", "The law came.", 1),
    ),
    ("mnli", "dev_mismatched"): (
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
        "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\t"
        "label4\tlabel5\tgold_label",
        "0\t75290\t75290c\tletters\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tYour gift is appreciated.\t"
        "Hundreds of students will benefit.\tneutral\tneutral\tneutral\tneutral\tneutral\tneutral",
        ("Your gift is appreciated.", "Hundreds of students will benefit.", 1),
    ),
    ("mnli", "train"): (
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
        "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
        "0\t31193\t31193n\tgovernment\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tConceptually cream "
        "skimming.\tProduct and geography.\tneutral\tcontradiction",
        ("Conceptually cream skimming.", "Product and geography.", 2),
    ),
}  # fmt: skip


@pytest.mark.parametrize("task, split", sorted(STANDARD_FILES))
def test_standard_layout_of_tasks_not_held_locally(tmp_path, task, split):
    header, row, expected = STANDARD_FILES[(task, split)]
    folder = tmp_path / tasks.get_task(task).folder
    folder.mkdir()
    (folder / f"{split}.tsv").write_text(f"{header}\n{row}\n", encoding="utf-8")
    assert glue.load_tsv(tmp_path, task, split) == [tasks.Example(*expected, 0)]


def _write(tmp_path, task, text, split="dev"):
    folder = tmp_path / tasks.get_task(task).folder
    folder.mkdir(exist_ok=True)
    path = folder / f"{split}.tsv"
    path.write_text(text, encoding="utf-8")
    return path


def test_missing_file_names_the_path_and_both_ways_to_supply_glue(tmp_path):
    with pytest.raises(tasks.GlueDataNotFound, match=r"RTE/train\.tsv") as caught:
        glue.load_tsv(tmp_path, "rte", "train")
    assert isinstance(caught.value, FileNotFoundError)
    message = str(caught.value)
    assert (
        "\n" not in message and "glue_data folder" in message and "tensorflow-datasets" in message
    )


def test_missing_column_names_file_line_and_column(tmp_path):
    path = _write(tmp_path, "rte", "index\tsentence1\tsentence2\tgold\n0\ta\tb\tentailment\n")
    with pytest.raises(ValueError, match=rf"{path}:1: header lacks column 'label'"):
        glue.load_tsv(tmp_path, "rte", "dev")


def test_unknown_label_names_file_and_line(tmp_path):
    path = _write(
        tmp_path, "rte", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n"
    )
    with pytest.raises(ValueError, match=rf"{path}:3: unknown label 'maybe'"):
        glue.load_tsv(tmp_path, "rte", "dev")
    path = _write(tmp_path, "cola", "src\t1\t\tok\nsrc\t2\t*\tbad\n")  # header-less CoLA
    with pytest.raises(ValueError, match=rf"{path}:2: unknown label '2'"):
        glue.load_tsv(tmp_path, "cola", "dev")


def test_bad_score_names_file_and_line(tmp_path):
    header = (
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    )
    path = _write(tmp_path, "stsb", f"{header}\n0\tg\tf\ty\t0\ts\ts\ta\tb\tn/a\n")
    with pytest.raises(ValueError, match=rf"{path}:2: 'score' is 'n/a'"):
        glue.load_tsv(tmp_path, "stsb", "dev")


@pytest.mark.parametrize("row", ["0\ta\tentailment", "0\ta\tb\tentailment\textra", " "])
def test_wrong_number_of_fields_names_file_and_line(tmp_path, row):
    path = _write(
        tmp_path, "rte", f"index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n{row}\n"
    )
    with pytest.raises(
        tasks.GlueDataInvalid, match=rf"{path}:3: \d tab-separated fields, expected 4"
    ):
        glue.load_tsv(tmp_path, "rte", "dev")


RTE_DEV = "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\tc\td\tnot_entailment\n"


@pytest.mark.parametrize("ending", ["\n", "\n\n", "\r\n\r\n", "\n\n\n"])
def test_blank_lines_at_the_end_are_skipped(tmp_path, ending):
    """A newline too many at the end of a file is common and harmless: the same examples."""
    _write(tmp_path, "rte", RTE_DEV.removesuffix("\n") + ending)
    assert glue.load_tsv(tmp_path, "rte", "dev") == [
        tasks.Example("a", "b", 0, 0),
        tasks.Example("c", "d", 1, 1),
    ]


@pytest.mark.parametrize("blank", ["\n", "\r\n"])
def test_blank_line_before_a_data_row_names_its_line(tmp_path, blank):
    """A blank line inside the file (a cut or merged file) is refused with its line number."""
    lines = RTE_DEV.splitlines(keepends=True)
    path = _write(tmp_path, "rte", "".join([*lines[:2], blank, *lines[2:]]))
    with pytest.raises(tasks.GlueDataInvalid, match=rf"^{path}:3: blank line before line 4"):
        glue.load_tsv(tmp_path, "rte", "dev")


def test_crlf_and_bom_files_load_as_lf_ones(tmp_path):
    """CRLF line ends and a UTF-8 BOM (MRPC's files have one) change no field or label."""
    header = (
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    )
    rows = ['0\tg\tf\ty\t0\ts\ts\tA "man\tB\t4.25', "1\tg\tf\ty\t1\ts\ts\tC\tD\t0"]
    text = "\n".join([header, *rows]) + "\n"
    expected = [tasks.Example('A "man', "B", 4.25, 0), tasks.Example("C", "D", 0.0, 1)]
    for name, data in (
        ("lf", text.encode()),
        ("crlf", text.replace("\n", "\r\n").encode()),
        ("bom+crlf", b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode()),
    ):
        path = _write(tmp_path, "stsb", "")
        path.write_bytes(data)
        assert glue.load_tsv(tmp_path, "stsb", "dev") == expected, name
    # A lone "\r" inside a field is not a line end (a text-mode reader would split there).
    path.write_bytes(text.replace('A "man', "A\rman").encode())
    assert glue.load_tsv(tmp_path, "stsb", "dev")[0].text_a == "A\rman"


def _imports(path) -> set[str]:
    """The modules `path` imports, anywhere in it (module level or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_data_modules_import_no_cycle_and_keep_their_names():
    """glue (the TSVs, `load`) and tfds_source both import the registry module `tasks`; tfds_source
    never imports glue, and the import graph of isojax.data (function-level imports included)
    has no cycle. The registry's names live in `tasks` alone: glue does not re-export them."""
    folder = pathlib.Path(glue.__file__).parent
    modules = {path.stem: path for path in folder.glob("*.py") if path.stem != "__init__"}
    graph = {
        name: {m for m in modules if f"isojax.data.{m}" in _imports(path) and m != name}
        for name, path in modules.items()
    }
    assert "glue" not in graph["tfds_source"] and "tasks" in graph["tfds_source"], graph
    assert graph["tasks"] == set(), graph
    done, active = set(), []

    def visit(name):
        assert name not in active, f"import cycle: {' -> '.join([*active, name])}"
        if name not in done:
            active.append(name)
            for other in graph[name]:
                visit(other)
            active.pop()
            done.add(name)

    for name in graph:
        visit(name)

    for name in ("TASKS", "GlueTask", "Example", "get_task", "GlueDataNotFound", "GlueDataInvalid"):
        assert hasattr(tasks, name) and not hasattr(glue, name), name
    assert glue.load_tfds is tfds_source.load_tfds
    assert issubclass(tasks.GlueDataInvalid, ValueError)


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = _write(tmp_path, "rte", "index\tsentence1\tsentence2\tlabel\n")
    path.write_bytes(path.read_bytes() + b"0\ta\xff\tb\tentailment\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8"):
        glue.load_tsv(tmp_path, "rte", "dev")


def test_unknown_task_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown GLUE task 'wnli'; known tasks: \['cola',"):
        glue.load_tsv(tmp_path, "wnli", "dev")
    with pytest.raises(ValueError, match=r"unknown GLUE source 'hub'"):
        glue.load("rte", "dev", source="hub")


# --- test splits: unlabelled examples of GLUE's leaderboard sets. ------------------------------

# SOURCE.md of ../shared/data/glue: test rows, and the first row's sentences.
TEST_SETS = {
    "cola": (1063, ("Bill whistled past the house.", None)),
    "mrpc": (1725, ("PCCW 's chief operating officer , Mike Butcher , and Alex Arena , the chief "
                    "financial officer , will report directly to Mr So .",
                    "Current Chief Operating Officer Mike Butcher and Group Chief Financial "
                    "Officer Alex Arena will report to So .")),
    "rte": (3000, ("Mangla was summoned after Madhumita's sister Nidhi Shukla, who was the first "
                   "witness in the case.", "Shukla is related to Mangla.")),
    "stsb": (1379, ("A girl is styling her hair.", "A girl is brushing her hair.")),
}  # fmt: skip


@pytest.mark.parametrize("task", sorted(TEST_SETS))
def test_test_split_rows_are_unlabelled(glue_dir, task):
    rows, first = TEST_SETS[task]
    examples = glue.load_tsv(glue_dir, task, "test")
    assert len(examples) == rows
    assert [e.idx for e in examples] == list(range(rows))
    assert all(e.label is None for e in examples)
    assert (examples[0].text_a, examples[0].text_b) == first
    pair = tasks.get_task(task).is_pair
    assert all((e.text_b is not None) == pair and e.text_a for e in examples)


@pytest.mark.parametrize("source", ["tsv", "tfds"])
def test_training_and_evaluation_refuse_a_test_split(tmp_path, glue_dir, source):
    data_dir = glue_dir if source == "tsv" else tmp_path
    with pytest.raises(ValueError, match=r"rte split 'test' has no labels.*\['train', 'dev'\]"):
        glue.load("rte", "test", source=source, data_dir=data_dir, labelled=True)
    with pytest.raises(ValueError, match=r"'test_mismatched' has no labels.*'dev_matched'"):
        glue.load("mnli", "test_mismatched", source=source, data_dir=data_dir, labelled=True)
    assert glue.load_tsv(glue_dir, "rte", "dev", labelled=True)[0].label == 1


# The header and a row of the standard GLUE test files of the tasks not held locally.
STANDARD_TEST_FILES = {
    ("sst2", "test"): ("index\tsentence", "0\tuneasy mishmash .", ("uneasy mishmash .", None)),
    ("qqp", "test"): ("id\tquestion1\tquestion2", "0\tHow?\tWhy \"so?", ("How?", 'Why "so?')),
    ("qnli", "test"): ("index\tquestion\tsentence", "0\tWhat?\tThis.", ("What?", "This.")),
    ("mnli", "test_matched"): (
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
        "sentence1_parse\tsentence2_parse\tsentence1\tsentence2",
        "0\t31493\t31493\ttravel\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tHierbas, ans seco.\tThe drink.",
        ("Hierbas, ans seco.", "The drink."),
    ),
}  # fmt: skip


@pytest.mark.parametrize("task, split", sorted(STANDARD_TEST_FILES))
def test_standard_test_files_of_tasks_not_held_locally(tmp_path, task, split):
    header, row, (text_a, text_b) = STANDARD_TEST_FILES[(task, split)]
    _write(tmp_path, task, f"{header}\n{row}\n", split=split)
    assert glue.load_tsv(tmp_path, task, split) == [tasks.Example(text_a, text_b, None, 0)]


def test_bad_test_file_names_file_and_line(tmp_path):
    path = _write(tmp_path, "rte", "index\tsentence1\tsentence2\n0\ta\tb\n1\ta\n", split="test")
    with pytest.raises(ValueError, match=rf"{path}:3: 2 tab-separated fields, expected 3"):
        glue.load_tsv(tmp_path, "rte", "test")
    path = _write(tmp_path, "cola", "index\ttext\n0\ta\n", split="test")  # CoLA test has a header
    with pytest.raises(ValueError, match=rf"{path}:1: header lacks column 'sentence'"):
        glue.load_tsv(tmp_path, "cola", "test")
    with pytest.raises(tasks.GlueDataNotFound, match=r"MNLI/test_matched\.tsv"):
        glue.load_tsv(tmp_path, "mnli", "test_matched")
