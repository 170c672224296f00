#!/usr/bin/env bash
# Install the cluster tier's real daemons from the Debian registry when they are missing: SLURM (slurmctld,
# slurmd, sbatch/srun/scontrol), munge and OpenSSH (sshd, ssh). Root only; does nothing when all are
# present. The packages' own service scripts start nothing (no systemd; tests/cluster starts private
# daemons in network namespaces and stops them again). Run by scripts/test.sh as root, and by the cluster
# tier's fixture when the tools are still missing.
#
# Usage: bash scripts/install_cluster_tools.sh        (exit 0: installed or already there; 2: cannot install)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0; fi

TOOLS=(slurmctld slurmd sbatch srun scontrol scancel munged sshd ssh ssh-keygen)
missing=()
for t in "${TOOLS[@]}"; do
  command -v "$t" >/dev/null 2>&1 || [[ -x "/usr/sbin/$t" ]] || missing+=("$t")
done
(( ${#missing[@]} == 0 )) && exit 0
die() { echo "install_cluster_tools: $*" >&2; exit 2; }
(( EUID == 0 )) || die "missing ${missing[*]} and not root: install slurm-wlm, munge and openssh-server as root"
command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get: install SLURM, munge and OpenSSH with this system's package manager"
echo "install_cluster_tools: missing ${missing[*]}: installing slurm-wlm, munge, openssh-server (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || die "apt-get update failed"
apt-get install -y -q --no-install-recommends slurm-wlm slurmctld slurmd slurm-client munge \
  openssh-server openssh-client >/dev/null || die "apt-get install of slurm-wlm munge openssh-server failed"
