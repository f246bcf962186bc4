// Default locations shared by the daemon and its clients.
#pragma once

#include <string>

namespace opjit {

// $OPJIT_STATE_DIR, else $HOME/.opjit, else /tmp/opjit-<uid>.
std::string DefaultStateDir();

// "unix:<state_dir>/opjitd.sock".
std::string DefaultSocketAddress(const std::string& state_dir);

// Where the packaged systemd unit's opjitd listens.
inline constexpr const char* kSystemSocket = "/run/opjit/opjitd.sock";

// Where clients connect by default: $OPJIT_SERVER, else the user's default
// socket, else (when that does not exist and OPJIT_STATE_DIR is unset) the
// system daemon's kSystemSocket if it exists.
std::string DefaultServerAddress();

// Where opjitd's helper programs (opjit-compile-worker, opjit-exec-worker,
// opjit-gpu-sandbox) live, given the directory of opjitd itself:
// <exe_dir>/../libexec/opjit in an installed tree (cmake --install, the
// Debian package; wherever it was unpacked), else exe_dir (the build tree).
std::string FindHelperDir(const std::string& exe_dir);

// The whole of a small file, such as one under /proc or /sys: at most about
// 1 MiB of it, "" if it cannot be read. EINTR-safe; for any thread.
std::string ReadSmallFile(const std::string& path);

}  // namespace opjit
