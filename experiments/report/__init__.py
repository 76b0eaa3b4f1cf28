"""A study's report from its results JSONL: `python -m experiments.report RESULTS.jsonl`
(`page`), and the documentation's findings page: `python -m experiments.report.findings`
(`findings`)."""
