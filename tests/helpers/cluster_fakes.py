"""Stand-ins for cluster tools, written as executables into a folder the test puts first on PATH: only for the
quick argument-handling checks (tests/integration/distributed/test_multinode_contract.py); the SLURM and PBS scripts run
under a real slurmctld/slurmd and sshd in tests/cluster/test_slurm.py.

Every call is appended to $FAKE_LOG; every "node" runs on this machine.
"""
import stat


def write_tool(folder, name, text):
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_slurm(folder):
    """srun: one task per host of SLURM_JOB_NODELIST, with SLURM_NODEID etc.; exits with the highest task exit
    code. scontrol: 'show hostnames a,b,c', 'requeue ID' (logged), '-o show job ID' (FAKE_JOB) and
    '-o show node NAME' (FAKE_DOWN names the one node that is down)."""
    write_tool(folder, "srun", """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
while [[ "${1:-}" == -* ]]; do shift; done
IFS=, read -r -a hosts <<< "$SLURM_JOB_NODELIST"
pids=()
for i in "${!hosts[@]}"; do
  h="${hosts[$i]}"
  task=(env SLURM_NODEID="$i" SLURM_PROCID="$i" SLURM_LOCALID=0 SLURMD_NODENAME="$h" "$@")
  "${task[@]}" &
  pids+=("$!")
done
rc=0
for p in "${pids[@]}"; do wait "$p"; r=$?; if (( r > rc )); then rc=$r; fi; done
exit "$rc"
""")
    write_tool(folder, "scontrol", """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  requeue*) ;;
  "-o show")  # FAKE_JOB: the job's `scontrol -o show job` line; FAKE_DOWN: a node shown DOWN, not responding
    if [[ "$3" == job && -n "${FAKE_JOB:-}" ]]; then echo "JobId=$4 $FAKE_JOB";
    elif [[ "$3" == node && "$4" == "${FAKE_DOWN:-}" ]]; then
      echo "NodeName=$4 Arch=x86_64 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 \
Reason=Not responding [root@2026-12-01T15:23:42]";
    elif [[ "$3" == node ]]; then echo "NodeName=$4 Arch=x86_64 State=ALLOCATED ThreadsPerCore=1";
    else echo "fake scontrol: unsupported: $*" >&2; exit 1; fi ;;
  *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
""")


def fake_ssh(folder):
    """ssh [-n] [-o opt] HOST COMMAND: runs COMMAND with bash -c on this machine with a clean environment
    (HOME, PATH only), as sshd would: the PBS script must send everything the node needs."""
    write_tool(folder, "ssh", """#!/usr/bin/env bash
while [[ "${1:-}" == -* ]]; do case "$1" in -o|-p|-l|-i|-F) shift 2 ;; *) shift ;; esac; done
host="$1"; shift
echo "ssh $host $*" >> "$FAKE_LOG"
exec env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin bash -c "$*"
""")
