#!/usr/bin/env bash
# GPU calls 2..: stash one more part of the SmolLM2 wheel (argument: its folder name under .gpu, e.g. p2).
[ -f /tmp/stash/p1 ] || { echo "part 1 is gone: the machine was given back; start again with s1.sh"; exit 3; }
cp ".gpu/$1/p" "/tmp/stash/$1" && ls -l /tmp/stash && echo "s2 ok: $1"
