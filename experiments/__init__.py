"""The experiments around isojax: the study runner (`experiments.study`), the study reports
(`experiments.report`), examples (`experiments.examples`), benchmarks (`experiments.bench`)
and the configs they read (`experiments.configs`). See experiments/README.md."""
