"""The study runner: `python -m experiments.study GRID [--tier N ...]` (`command`, the command
line; `runner`, the grid's loop; `ray_cells`, the cells as Ray tasks), over a grid file's cells
(`grid`), one cell's run (`cell`), the results file and claims (`records`), time
estimates (`eta`), continuing at a recorded commit (`commit`), and the post-hoc analysis of a
study's runs (`python -m experiments.study.analyze`, `analyze`)."""
