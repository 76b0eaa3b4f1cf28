"""`python -m experiments.report RESULTS.jsonl`: a study's report (`experiments.report.page`)."""

import sys

from experiments.report.page import main

sys.exit(main())
