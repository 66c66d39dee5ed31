#!/bin/bash
# lab/run tests/lab/verbs-pg-proto.sh: the cross-process QP prototype (verbs_pg_proto.py) on rxe0
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD
timeout 240 "$PWD/.venv/bin/python" -X faulthandler tests/lab/verbs_pg_proto.py "${LAB_IP:-10.99.0.1}"
