"""A regression head's bias starts at the training labels' mean (`label_mean_bias`, issue 62):
a head that centres its input (recenter, batchnorm, whiten, iternorm) cannot learn STS-B's
label mean (2.7) through its weights, and AdamW moves the bias by about lr per step, so without
it `isojax predict` writes scores offset by about the mean."""

import csv

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import one_device_mesh, tiny_config, tiny_encoder_config

from isojax import linen, runs
from isojax.data import glue, tasks
from isojax.nnx import export as nnx_export
from isojax.runs import predict
from isojax.training import build, loop, specs


def _labels_by_csv(glue_dir, split: str) -> np.ndarray:
    """STS-B's scores read with the csv module (not isojax's reader): the last column."""
    with open(glue_dir / "STS-B" / f"{split}.tsv", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return np.asarray([float(row[-1]) for row in rows[1:]], np.float64)


def test_output_bias_is_the_float64_mean_of_the_training_labels(glue_dir, minilm_dir):
    config = tiny_config(glue_dir, minilm_dir, task="stsb", max_train_examples=None)
    spec = specs.RunSpec.of(config)
    stsb = tasks.get_task("stsb")
    train = build.load_examples(spec.data, "train")
    want = _labels_by_csv(glue_dir, "train").mean()
    assert abs(want - 2.70) < 0.01  # the figure the issue quotes
    assert build.output_bias(spec.model, stsb, train) == pytest.approx(want, abs=1e-12)
    config.label_mean_bias = False
    assert build.output_bias(specs.RunSpec.of(config).model, stsb, train) == 0.0
    rte = tasks.get_task("rte")
    assert build.output_bias(spec.model, rte, glue.load_tsv(glue_dir, rte, "dev")) == 0.0


@pytest.mark.parametrize("bias", [0.0, 2.7])
def test_both_front_ends_start_their_classifier_bias_at_output_bias(bias):
    encoder = linen.Encoder(tiny_encoder_config())
    head = linen.SequenceClassifier(encoder, num_labels=1, normalizer="iternorm", output_bias=bias)
    variables = linen.init_variables(head, jax.random.key(0), None)
    np.testing.assert_array_equal(variables["params"]["classifier"]["bias"], np.float32([bias]))
    twin = nnx_export.from_linen(head, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(twin.classifier.bias[...], np.float32([bias]))
    back, _ = nnx_export.to_linen(twin)
    assert back.output_bias == bias


def _dev_mean_of_predict(tmp_path, glue_dir, minilm_dir, label_mean_bias: bool) -> float:
    config = tiny_config(
        glue_dir,
        minilm_dir,
        task="stsb",
        normalizer="iternorm",
        max_train_examples=64,
        max_eval_examples=64,
        label_mean_bias=label_mean_bias,
    )
    workdir = tmp_path / str(label_mean_bias)
    loop.train_and_evaluate(config, workdir, mesh=one_device_mesh())
    return float(predict.predict(runs.restore(workdir), "dev").logits[:, 0].mean())


@pytest.mark.e2e  # two whole runs
def test_a_centred_regression_head_predicts_on_the_labels_scale(tmp_path, glue_dir, minilm_dir):
    """`iternorm` whitens the head's input (mean 0), so the scores' mean is about the bias: at
    the mean of the labels it trained on (the first 64 rows: 3.54; the TSVs are ordered by
    source, so a prefix's mean is not the file's) with `label_mean_bias`, and far from it
    without."""
    labels = _labels_by_csv(glue_dir, "train")[:64].mean()
    with_bias = _dev_mean_of_predict(tmp_path, glue_dir, minilm_dir, True)
    without = _dev_mean_of_predict(tmp_path, glue_dir, minilm_dir, False)
    assert abs(with_bias - labels) < 0.3, (with_bias, labels)
    assert abs(without - labels) > 2.0, (without, labels)
