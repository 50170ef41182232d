mkdir -p $OUT
for i in 1 2; do
for v in serial push; do
  cp dev/common_$v.py kernels/common.py
  CAKE_CUTE_CACHE_DIR=$PWD/dev/cache_$v timeout 140 cake-cute bench --hidden 16384,32768,65536,131072 --vs none --no-plot --reps 10 --prof-reps 6 --json $OUT/$v$i.json > $OUT/$v$i.log 2>&1
  echo "== $v $i rc=$?"; grep -E "^cake_cute" $OUT/$v$i.log | awk '{print $2,$3,$5,$7,$8}' | tr '\n' ';'; echo
done
done
cp dev/common_push.py kernels/common.py
