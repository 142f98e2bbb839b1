#!/bin/sh
# Install a CapyCTL release: curl -fsSL <releases>/latest/install.sh | sh
#
# It downloads the release's SHA256SUMS and its signature SHA256SUMS.sig, and refuses a
# release whose SHA256SUMS the CapyCTL release key, whose public half this script carries, did
# not sign (ssh-keygen -Y verify, OpenSSH 8.1 or newer). It downloads the executable for this
# machine, refuses any file whose SHA-256 differs from the one SHA256SUMS lists, puts it in
# <prefix>/lib/capyctl/<version>/ and links <prefix>/bin/capyctl to it: the self-contained
# executable (capyctl-<version>-linux-<arch>, its own Python inside) where the release has one
# for this machine, else, or with --pex, the pex (capyctl-<version>-linux-<arch>.pex), unpacked
# into a virtual environment on the system's Python 3.11+. The
# prefix is /usr/local as root and ~/.local otherwise. Other versions stay installed beside
# it, so `install.sh --version <previous>` rolls back; running it twice is harmless; it never
# reads or writes a state dir. Debian's redis-server is installed where it is missing (as
# root; otherwise the command is printed).
#
# Options (after `sh -s --` when piped):
#   --version vX.Y.Z   install this release instead of the latest (from <releases>/vX.Y.Z/)
#   --releases URL|DIR where releases are published: <releases>/latest/, <releases>/vX.Y.Z/
#                      (default $CAPYCTL_RELEASES, else the address this script came with)
#   --from URL|DIR     one release's folder itself, such as scripts/release's dist/
#   --prefix DIR       install under DIR instead (DIR/bin/capyctl, DIR/lib/capyctl/)
#   --pex              install the pex on the system's Python, not the self-contained one
set -eu
# What it installs is read by other users (a system unit's `capyctl` user), whatever the
# caller's umask.
umask 022

# Where this release's releases are published; scripts/release writes it (CAPYCTL_RELEASE_URL).
RELEASES_URL=""
# The public half of the key that signs the releases' SHA256SUMS; scripts/release writes it.
# The repository's copy of this script carries none, and installs nothing.
RELEASE_SIGNER=""

say() { printf 'install: %s\n' "$*"; }
fail() {
    printf 'install: %s\n' "$*" >&2
    exit 1
}

releases=${CAPYCTL_RELEASES:-$RELEASES_URL}
from=""
version=""
prefix=""
kind=""
while [ $# -gt 0 ]; do
    case $1 in
    --version) [ $# -ge 2 ] || fail "--version needs a value"; version=$2; shift 2 ;;
    --releases) [ $# -ge 2 ] || fail "--releases needs a value"; releases=$2; shift 2 ;;
    --from) [ $# -ge 2 ] || fail "--from needs a value"; from=$2; shift 2 ;;
    --prefix) [ $# -ge 2 ] || fail "--prefix needs a value"; prefix=$2; shift 2 ;;
    --pex) kind=pex; shift ;;
    -h | --help) sed -n '2,23p' "$0" 2>/dev/null || true; exit 0 ;;
    *) fail "unknown option $1 (see --help)" ;;
    esac
done
version=${version#v}

# A version as scripts/release builds one (X.Y.Z, then letters, digits and dots): checked
# before it is part of a URL or a path.
valid_version() {
    case $1 in
    "" | *[!0-9a-z.]*) return 1 ;;
    esac
    [ ${#1} -le 64 ] && printf '%s\n' "$1" | awk '!/^[0-9]+\.[0-9]+\.[0-9]+[.a-z0-9]*$/ { exit 1 }'
}
if [ -n "$version" ] && ! valid_version "$version"; then
    fail "--version $version is not a CapyCTL version (X.Y.Z, such as v0.1.0)"
fi

if [ -z "$from" ]; then
    [ -n "$releases" ] || fail "no release source: pass --releases URL or --from DIR"
    if [ -n "$version" ]; then from=${releases%/}/v$version; else from=${releases%/}/latest; fi
fi
from=${from%/}

if [ -z "$prefix" ]; then
    if [ "$(id -u)" = 0 ]; then prefix=/usr/local; else prefix=${HOME:?}/.local; fi
fi

case $(uname -s)-$(uname -m) in
Linux-x86_64 | Linux-amd64) arch=x86_64 ;;
Linux-aarch64 | Linux-arm64) arch=aarch64 ;;
*) fail "no release for $(uname -s) on $(uname -m): CapyCTL runs on Linux, x86-64 or ARM64" ;;
esac

python=${PYTHON:-python3}
check_python() {
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
        fail "the pex needs Python 3.11 or newer as $python; on Debian: sudo apt-get install -y" \
            "python3 (or install the self-contained executable: drop --pex)"
}

# Fetch one file of the release into a local path: a URL with curl (or wget), a folder by copy;
# a failure says $3 when given.
fetch() {
    case $from in
    http://* | https://*)
        if command -v curl >/dev/null 2>&1; then
            curl -fsSL --retry 3 -o "$2" "$from/$1" || fail "${3:-cannot download $from/$1}"
        else
            wget -q -O "$2" "$from/$1" || fail "${3:-cannot download $from/$1}"
        fi
        ;;
    file://*) cp "${from#file://}/$1" "$2" 2>/dev/null || fail "${3:-no $1 in ${from#file://}}" ;;
    *) cp "$from/$1" "$2" 2>/dev/null || fail "${3:-no $1 in $from}" ;;
    esac
}

# Refuse the release unless the release key signed its SHA256SUMS: a mirror or a proxy that
# serves other files cannot make that signature.
check_signature() {
    [ -n "$RELEASE_SIGNER" ] || fail "this install.sh carries no release key (it is the" \
        "repository's copy): run the install.sh published with a release, or one that" \
        "scripts/release wrote"
    command -v ssh-keygen >/dev/null 2>&1 || fail "checking the release's signature needs" \
        "ssh-keygen from OpenSSH 8.1 or newer; on Debian: sudo apt-get install -y openssh-client"
    fetch SHA256SUMS.sig "$work/SHA256SUMS.sig" \
        "the release at $from has no signature (SHA256SUMS.sig); refusing it"
    printf 'capyctl-release namespaces="capyctl-release" %s\n' "$RELEASE_SIGNER" >"$work/signers"
    if ! said=$(ssh-keygen -Y verify -f "$work/signers" -I capyctl-release -n capyctl-release \
        -s "$work/SHA256SUMS.sig" <"$work/SHA256SUMS" 2>&1); then
        case $said in
        *"option -- "*Y*) fail "checking the release's signature needs ssh-keygen from OpenSSH" \
            "8.1 or newer; $(command -v ssh-keygen) is older" ;;
        esac
        fail "SHA256SUMS of the release at $from is not signed by the CapyCTL release key;" \
            "refusing the release (a damaged download, or a mirror that serves other files)"
    fi
}

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

# The file's hash as SHA256SUMS lists it, or nothing.
listed() { awk -v name="$1" '$2 == name || $2 == "*" name { print $1; exit }' "$work/SHA256SUMS"; }

# Refuse a file whose SHA-256 is not the one SHA256SUMS lists, naming it.
verify() {
    expected=$(listed "$1")
    [ -n "$expected" ] || fail "$1 is not listed in $from/SHA256SUMS; refusing it"
    actual=$(sha256 "$2")
    [ "$actual" = "$expected" ] ||
        fail "$1 does not match SHA256SUMS (listed $expected, downloaded $actual); refusing it"
}

work=$(mktemp -d "${TMPDIR:-/tmp}/capyctl-install.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM

fetch SHA256SUMS "$work/SHA256SUMS"
check_signature
# The executable of this machine: the self-contained one unless --pex (or the release has none).
named() {
    awk -v pattern="^[*]?capyctl-.*-linux-$arch$1\$" '$2 ~ pattern { sub(/^[*]/, "", $2); print $2; exit }' \
        "$work/SHA256SUMS"
}
file=""
[ "$kind" = pex ] || { file=$(named ""); [ -z "$file" ] || kind=binary; }
if [ -z "$file" ]; then
    file=$(named "[.]pex")
    kind=pex
fi
[ -n "$file" ] || fail "the release at $from has no executable for linux-$arch"
found=${file#capyctl-}
found=${found%.pex}
found=${found%-linux-"$arch"}
valid_version "$found" ||
    fail "the release at $from names its executable $file, whose version is not X.Y.Z; refusing it"
if [ -n "$version" ] && [ "$found" != "$version" ]; then
    fail "the release at $from is $found, not $version"
fi
version=$found

home=$prefix/lib/capyctl/$version
if [ -f "$home/installed" ] && [ -f "$home/$file" ] && [ "$(sha256 "$home/$file")" = "$(listed "$file")" ]; then
    say "capyctl $version is already installed in $home"
else
    fetch "$file" "$work/$file"
    verify "$file" "$work/$file"
    say "installing capyctl $version into $home"
    rm -rf "$home"
    mkdir -p "$home"
    cp "$work/SHA256SUMS" "$work/$file" "$home/"
    if [ "$kind" = pex ]; then
        # Unpacked once into a virtual environment on the system's Python: the services
        # start from it, and nothing is unpacked again at run time.
        check_python
        PEX_TOOLS=1 "$python" "$home/$file" venv --site-packages-copies --disable-cache \
            --compile "$home/venv" >/dev/null || fail "cannot unpack $file with $python"
        ln -sf venv/bin/capyctl "$home/capyctl"
    else
        chmod 0755 "$home/$file"
        ln -sf "$file" "$home/capyctl"
    fi
    : >"$home/installed"
fi

mkdir -p "$prefix/bin"
ln -sf "$home/capyctl" "$prefix/bin/.capyctl.$$"
mv -f "$prefix/bin/.capyctl.$$" "$prefix/bin/capyctl"
"$prefix/bin/capyctl" --version >/dev/null || fail "$prefix/bin/capyctl does not run"
say "$prefix/bin/capyctl is capyctl $version"

others=$(cd "$prefix/lib/capyctl" && for dir in *; do
    [ "$dir" != "$version" ] && [ -f "$dir/installed" ] && printf ' %s' "$dir"
done || true)
[ -z "$others" ] || say "also installed:$others (install.sh --version <one> switches back)"

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing redis-server from Debian"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    else
        say "CapyCTL needs redis-server; install it with: sudo apt-get install -y redis-server"
    fi
fi

case ":$PATH:" in
*":$prefix/bin:"*) ;;
*) say "$prefix/bin is not on your PATH; add it: export PATH=\"$prefix/bin:\$PATH\"" ;;
esac
say "done: run \`capyctl --version\`, then \`capyctl demo\`"
