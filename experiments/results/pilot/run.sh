#!/usr/bin/env bash
# Pilot for issue 14: method none, seed 1, lr 1e-4, batch 32, max len 128, 3 epochs, per task.
cd /work/wt-pilot
export PYTHONPATH=/work/wt-pilot
for t in stsb rte mrpc cola; do
  /usr/bin/time -f "$t wall %e s" nice -n 19 /work/main/.venv/bin/python -m isojax.cli finetune --task $t --method none \
    --data-dir /work/shared/data/glue --workdir /work/pilot/$t-lr1e-4 --seed 1 \
    --set optimizer.learning_rate=1e-4 --set num_epochs=3 --set batch_size=32 --set max_length=128 \
    --set progress=False --set log_every=25 > /work/pilot/$t.log 2>&1
done
echo done > /work/pilot/DONE
