"""`python -m experiments.study GRID [options]`: the study runner (`experiments.study.runner`)."""

import sys

from experiments.study.runner import main

sys.exit(main())
