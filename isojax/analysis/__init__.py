"""Isotropy reports (``isojax analyze``): of a pre-trained encoder's layers and sentence vectors
(:mod:`~isojax.analysis.encoder`), and of a fine-tuned run's classifier in its dev evaluation's
mode, the head's input included (:mod:`~isojax.analysis.run`); and post-hoc transforms of an
encoder's sentence vectors (BERT-whitening, all-but-the-top, ZCA) fitted on a task's train
sentences, with the dev vectors' isotropy and unsupervised pair scores before and after
(:mod:`~isojax.analysis.posthoc`, ``isojax analyze --posthoc``). Each report holds the
geometry of SPEC.md §10.4 (effective rank, RankMe, outlier dimensions) and, given train
sentences, the principal outlier's 1-D task score (:mod:`~isojax.analysis.outliers`). Its
table, ``summary.json`` and figures are written by :mod:`~isojax.analysis.figures`.

    rep = isojax.analysis.analyze_encoder(module, params, tokenizer, examples, ...)
    print(isojax.analysis.format_table(rep.summary))
"""

from isojax.analysis.encoder import GEOMETRY, HEAD_INPUT, Report, analyze_encoder
from isojax.analysis.figures import format_table, write_figures, write_summary
from isojax.analysis.run import analyze_run

__all__ = [
    "GEOMETRY",
    "HEAD_INPUT",
    "Report",
    "analyze_encoder",
    "analyze_run",
    "format_table",
    "write_figures",
    "write_summary",
]
