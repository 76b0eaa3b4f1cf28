"""`python -m experiments.study GRID [options]`: the study runner (`experiments.study.command`)."""

import sys

from experiments.study.command import main

sys.exit(main())
