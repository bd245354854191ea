"""A stand-in for the `gcloud` commands scripts/launch_tpu_pod.sh runs, acting on this machine.

State lives under $FAKE_GCLOUD_ROOT:
  slices/<name>/workers          how many workers the slice has (its presence: the slice exists)
  slices/<name>/unreachable      ssh to the slice fails (exit 255)
  slices/<name>/w<i>/            worker i's home directory ($HOME of its remote commands)
  queued/<name>/states           queued-resource states `describe` answers, one a line; the
                                 last one repeats
  queued/<name>/workers          workers of each slice `create` makes (default 2)
  calls.log                      every call, one a line

`tpu-vm ssh --command C` runs `bash -c C` once per selected worker, with HOME and the working
directory set to that worker's home; `tpu-vm scp` copies files between here and the homes.
"""
import os
import shutil
import subprocess
import sys

ROOT = os.environ['FAKE_GCLOUD_ROOT']


def _slice(name):
  return os.path.join(ROOT, 'slices', name)


def _workers(name, which):
  count = int(open(os.path.join(_slice(name), 'workers')).read())
  return list(range(count)) if which == 'all' else [int(which)]


def _opts(args):
  """(positional, {--flag: value}) of gcloud-style arguments (--f=v or --f v or --switch)."""
  pos, opts, i = [], {}, 0
  while i < len(args):
    a = args[i]
    if a.startswith('--'):
      if '=' in a:
        k, v = a.split('=', 1)
      elif i + 1 < len(args) and not args[i + 1].startswith('--'):
        k, v = a, args[i + 1]
        i += 1
      else:
        k, v = a, ''
      opts[k] = v
    else:
      pos.append(a)
    i += 1
  return pos, opts


def _reachable(name):
  if not os.path.isfile(os.path.join(_slice(name), 'workers')):
    print(f'ERROR: (gcloud.compute.tpus.tpu-vm) NOT_FOUND: {name}', file=sys.stderr)
    return False
  if os.path.exists(os.path.join(_slice(name), 'unreachable')):
    print(f'ssh: connect to host {name}: Connection timed out', file=sys.stderr)
    return False
  return True


def ssh(pos, opts):
  name = pos[0]
  if not _reachable(name):
    return 255
  rc = 0
  for w in _workers(name, opts.get('--worker', '0')):
    home = os.path.join(_slice(name), f'w{w}')
    os.makedirs(home, exist_ok=True)
    env = dict(os.environ, HOME=home)
    proc = subprocess.run(['bash', '-c', opts['--command']], cwd=home, env=env,
                          stdin=subprocess.DEVNULL)
    rc = max(rc, proc.returncode)
  return rc


def scp(pos, opts):
  src, dst = pos
  remote = src if ':' in src else dst
  name, path = remote.split(':', 1)
  if not _reachable(name):
    return 255
  for w in _workers(name, opts.get('--worker', '0')):
    there = os.path.join(_slice(name), f'w{w}', path)
    shutil.copy(there, dst) if remote == src else shutil.copy(src, there)
  return 0


def describe_vm(pos, opts):
  name = pos[0]
  if not os.path.isfile(os.path.join(_slice(name), 'workers')):
    print(f'ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: {name}', file=sys.stderr)
    return 1
  if 'networkEndpoints' in opts.get('--format', ''):
    print(';'.join(f'10.0.0.{w}' for w in _workers(name, 'all')))
  else:
    print('READY')
  return 0


def queued(verb, pos, opts):
  name = pos[0]
  here = os.path.join(ROOT, 'queued', name)
  if verb == 'create':
    os.makedirs(here, exist_ok=True)
    if not os.path.exists(os.path.join(here, 'states')):
      with open(os.path.join(here, 'states'), 'w') as f:
        f.write('ACTIVE\n')
    workers = '2'
    if os.path.exists(os.path.join(here, 'workers')):
      workers = open(os.path.join(here, 'workers')).read().strip()
    if '--node-id' in opts:
      nodes = [opts['--node-id']]
    else:
      nodes = [f'{opts["--node-prefix"]}-{i}' for i in range(int(opts['--node-count']))]
    for node in nodes:
      os.makedirs(_slice(node), exist_ok=True)
      with open(os.path.join(_slice(node), 'workers'), 'w') as f:
        f.write(workers)
      for w in range(int(workers)):
        os.makedirs(os.path.join(_slice(node), f'w{w}'), exist_ok=True)
    return 0
  if verb == 'describe':
    path = os.path.join(here, 'states')
    if not os.path.exists(path):
      print(f'ERROR: NOT_FOUND: {name}', file=sys.stderr)
      return 1
    states = open(path).read().split()
    print(states[0])
    if len(states) > 1:
      with open(path, 'w') as f:
        f.write('\n'.join(states[1:]) + '\n')
    return 0
  if verb == 'delete':
    shutil.rmtree(here, ignore_errors=True)
    return 0
  return 2


def main(argv):
  with open(os.path.join(ROOT, 'calls.log'), 'a') as f:
    f.write(' '.join(argv) + '\n')
  if argv[:3] != ['compute', 'tpus', 'tpu-vm'] and argv[:3] != ['compute', 'tpus',
                                                                  'queued-resources']:
    print(f'fake gcloud: unsupported {argv[:3]}', file=sys.stderr)
    return 2
  pos, opts = _opts(argv[4:])
  if argv[2] == 'queued-resources':
    return queued(argv[3], pos, opts)
  return {'ssh': ssh, 'scp': scp, 'describe': describe_vm}[argv[3]](pos, opts)


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
