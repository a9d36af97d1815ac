#!/bin/bash
cd /work/main && source .venv/bin/activate
python3 -c "while 1: pass" & P1=$!
python3 -c "while 1: pass" & P2=$!
for rep in 1 2; do
  for v in default s10000; do
    if [ $v = default ]; then env -u GOMP_SPINCOUNT monai-fast demo --no-progress --epoch-multiple 1 --run-dir /tmp/spinexp/$v-$rep > /tmp/spinexp/$v-$rep.log 2>&1
    else GOMP_SPINCOUNT=10000 monai-fast demo --no-progress --epoch-multiple 1 --run-dir /tmp/spinexp/$v-$rep > /tmp/spinexp/$v-$rep.log 2>&1; fi
    echo "$v-$rep done $(date)" >> /tmp/spinexp/progress
  done
done
kill $P1 $P2
