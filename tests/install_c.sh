#!/usr/bin/env bash
# Checks of scripts/install-c.sh that scripts/test.sh runs after its own install (the CMake
# build folder is then current, so each install here is a copy):
#  1. a relative prefix is the caller's directory's, not the checkout's;
#  2. a missing tool stops the script with its name and the command that installs it,
#     and nothing is installed from the package manager (apt-get and sudo are stand-ins
#     that record a call) unless --install-deps is given, and the help says Rust is the
#     user's to install (rustup), never the script's;
#  3. (as root) a run under sudo refuses to build as root, before building anything;
#  4. (as root, in a mount namespace of its own) a prefix the user cannot write: sudo gets
#     cmake by its path (sudo's secure_path may not have the user's), and the install
#     manifest sudo writes into the build folder is the user's afterwards (else the next
#     install as the user fails);
#  5. (likewise) `/usr/local/`, trailing slash and all, is /usr/local: ldconfig runs.
set -euo pipefail
# Run under sudo (as scripts/test.sh may be), the cases below are the tests' user's.
unset SUDO_USER
root=$(cd "$(dirname "$0")/.." && pwd)
script=$root/scripts/install-c.sh
work=$(mktemp -d)
name=install-c-check-$$
trap 'rm -rf "$work" "${root:?}/$name"' EXIT
fail() { echo "install_c.sh: FAILED: $*" >&2; exit 1; }

# 1. From another directory, a relative prefix.
mkdir "$work/caller"
(cd "$work/caller" && bash "$script" "$name/prefix" >/dev/null)
[ -f "$work/caller/$name/prefix/include/shmbridge.h" ] ||
    fail "a relative prefix was not installed under the caller's directory"
[ ! -e "$root/$name" ] || fail "a relative prefix was installed inside the checkout ($root/$name)"
echo "ok: a relative prefix is the caller's"

# 2. No cmake or pkg-config on PATH: every other command of PATH, and apt-get and sudo
# stand-ins that record being called.
bin=$work/bin
mkdir "$bin"
IFS=: read -ra dirs <<< "$PATH"
for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    for f in "$dir"/*; do
        tool=${f##*/}
        case "$tool" in cmake | pkg-config | apt-get | apt | sudo) continue ;; esac
        [ -x "$f" ] && [ ! -e "$bin/$tool" ] && ln -s "$f" "$bin/$tool"
    done
done
for tool in apt-get sudo; do
    printf '#!/bin/sh\necho "%s $*" >> "%s"\nexit 1\n' "$tool" "$work/called" > "$bin/$tool"
    chmod +x "$bin/$tool"
done
set +e
out=$(cd "$work/caller" && PATH=$bin bash "$script" "$work/missing" 2>&1)
status=$?
set -e
[ "$status" -ne 0 ] || fail "installed with no cmake on PATH"
[ ! -e "$work/called" ] || fail "ran the package manager unasked: $(cat "$work/called")"
case "$out" in *"missing: cmake pkg-config"*) ;; *) fail "did not name what is missing: $out" ;; esac
case "$out" in *"apt-get install cmake pkg-config"*"--install-deps"*) ;; *) fail "no command to install them: $out" ;; esac
[ ! -e "$work/missing" ] || fail "made the prefix though it stopped"
echo "ok: missing tools are named, nothing is installed unasked"

# The help promises nothing --install-deps cannot do: Rust is the user's (rustup).
help=$(bash "$script" --help)
deps_line=$(grep -e '--install-deps PREFIX' <<< "$help")
case "$deps_line" in *cargo*) fail "the help says --install-deps installs cargo: $deps_line" ;; esac
case "$help" in *rustup*) ;; *) fail "the help does not say to install Rust with rustup: $help" ;; esac
echo "ok: the help says Rust is installed with rustup"

# 3. Under sudo (as root, with SUDO_USER set): refused before the build.
if [ "$(id -u)" = 0 ]; then
    set +e
    out=$(cd "$work/caller" && SUDO_USER=nobody bash "$script" "$work/sudo" 2>&1)
    status=$?
    set -e
    [ "$status" -ne 0 ] || fail "built and installed as root under sudo"
    case "$out" in *"run it as nobody instead"*) ;; *) fail "did not say to run it as the user: $out" ;; esac
    [ ! -e "$work/sudo" ] || fail "installed under sudo"
    echo "ok: a run under sudo is refused before it builds"
else
    echo "skipped: the sudo check needs root (it sets SUDO_USER as sudo would)"
fi

# 4 and 5 change what root's mounts show, in a mount namespace of their own.
if [ "$(id -u)" != 0 ] || ! command -v unshare >/dev/null 2>&1; then
    echo "skipped: the sudo-install and ldconfig checks need root and unshare"
    exit 0
fi
stubs=$work/stubs
mkdir "$stubs"
manifest=$root/target/cmake-capi/install_manifest.txt
other=$(id -u nobody)
# sudo: records its arguments; the install it is asked for is done by a stand-in that
# leaves a manifest owned by someone else, as root's is to the user; anything else runs.
cat > "$stubs/sudo" <<EOF
#!/bin/sh
echo "\$*" >> "$work/sudo-args"
case "\$2" in
    --install) touch "$manifest" && chown $other "$manifest" ;;
    *) exec "\$@" ;;
esac
EOF
printf '#!/bin/sh\necho ldconfig >> "%s"\n' "$work/ldconfig-called" > "$stubs/ldconfig"
chmod +x "$stubs/sudo" "$stubs/ldconfig"

# 4. A prefix on a read-only mount (not writable even by root), after an earlier sudo
# install left its manifest.
mkdir "$work/readonly"
touch "$manifest" && chown "$other" "$manifest"
unshare -m --propagation private env PATH="$stubs:$PATH" SCRIPT="$script" PREFIX="$work/readonly" bash -c '
    mount -t tmpfs -o ro x "$PREFIX" && bash "$SCRIPT" "$PREFIX" >/dev/null 2>&1' ||
    fail "the install with sudo failed"
read -r cmake_path _ < "$work/sudo-args"
case "$cmake_path" in /*/cmake) ;; *) fail "sudo was not given cmake by its path: $(cat "$work/sudo-args")" ;; esac
[ "$(stat -c %u "$manifest")" = "$(id -u)" ] ||
    fail "the install manifest sudo wrote is not the user's: $(stat -c %U "$manifest")"
echo "ok: sudo runs cmake by its path; the install manifest stays the user's"

# 5. /usr/local/ (its lib and include folders hidden under empty ones).
unshare -m --propagation private env PATH="$stubs:$PATH" SCRIPT="$script" bash -c '
    mount -t tmpfs x /usr/local/lib && mount -t tmpfs x /usr/local/include &&
    bash "$SCRIPT" /usr/local/ >/dev/null && [ -f /usr/local/include/shmbridge.h ]' ||
    fail "the install into /usr/local/ failed"
[ -f "$work/ldconfig-called" ] || fail "no ldconfig after installing into /usr/local/"
echo "ok: /usr/local/ with a trailing slash runs ldconfig"
