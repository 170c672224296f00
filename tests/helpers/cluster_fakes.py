"""Stand-ins for cluster tools, written as executables into a folder the test puts first on PATH.

Every call is appended to $FAKE_LOG. With ``hosts`` (a tests/helpers/netns.Hosts), each node runs in its own
network namespace; without, on this machine.
"""
import stat


def write_tool(folder, name, text):
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_slurm(folder, hosts=None):
    """srun: one task per host of SLURM_JOB_NODELIST, in that host's namespace, with SLURM_NODEID etc.;
    exits with the highest task exit code. scontrol: 'show hostnames a,b,c' and 'requeue ID' (logged)."""
    ns = " ".join(f"[{h}]={n}" for h, n in zip(hosts.hostnames, hosts.names)) if hosts else ""
    write_tool(folder, "srun", f"""#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
while [[ "${{1:-}}" == -* ]]; do shift; done
declare -A NS=({ns})
IFS=, read -r -a hosts <<< "$SLURM_JOB_NODELIST"
pids=()
for i in "${{!hosts[@]}}"; do
  h="${{hosts[$i]}}"
  task=(env SLURM_NODEID="$i" SLURM_PROCID="$i" SLURM_LOCALID=0 SLURMD_NODENAME="$h" "$@")
  if [[ -n "${{NS[$h]:-}}" ]]; then
    ip netns exec "${{NS[$h]}}" unshare --uts -- bash -c 'hostname "$0" && exec "$@"' "$h" "${{task[@]}}" &
  else
    "${{task[@]}}" &
  fi
  pids+=("$!")
done
rc=0
for p in "${{pids[@]}}"; do wait "$p"; r=$?; if (( r > rc )); then rc=$r; fi; done
exit "$rc"
""")
    write_tool(folder, "scontrol", """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  requeue*) ;;
  *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
""")


def fake_ssh(folder, hosts=None):
    """ssh [-n] [-o opt] HOST COMMAND: runs COMMAND with bash -c in HOST's namespace with a clean environment
    (HOME, PATH only), as sshd would: the PBS script must send everything the node needs."""
    if hosts is None:  # local: a clean environment, no namespace
        run = 'exec env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin bash -c "$*"'
        ns = ""
    else:
        ns = " ".join(f"[{h}]={n}" for h, n in zip(hosts.hostnames, hosts.names))
        run = ('[[ -n "${NS[$host]:-}" ]] || { echo "ssh: Could not resolve hostname $host" >&2; exit 255; }\n'
               'exec ip netns exec "${NS[$host]}" unshare --uts -- env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin '
               'bash -c \'hostname "$0" && exec bash -c "$1"\' "$host" "$*"')
    write_tool(folder, "ssh", f"""#!/usr/bin/env bash
while [[ "${{1:-}}" == -* ]]; do case "$1" in -o|-p|-l|-i) shift 2 ;; *) shift ;; esac; done
host="$1"; shift
echo "ssh $host $*" >> "$FAKE_LOG"
declare -A NS=({ns})
{run}
""")
