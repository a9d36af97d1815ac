# your_trainer.py from the commit before session 12 (42a02f7, in a worktree at $OLD) and from this tree, taking
# turns, oneDNN/ATen limited to AVX2 (the no-bf16 emulation); each writes its JSON into old/ or new/
for r in 1 2; do
  for tree in old new; do
    src=$([ $tree = old ] && echo $OLD || echo $NEW)
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=$src python $src/benchmarks/your_trainer.py \
      --repeats 1 --epochs 6 --out $DIR/$tree
  done
done
