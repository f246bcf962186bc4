// Default locations shared by the daemon and its clients.
#pragma once

#include <string>

namespace opjit {

// $OPJIT_STATE_DIR, else $HOME/.opjit, else /tmp/opjit-<uid>.
std::string DefaultStateDir();

// "unix:<state_dir>/opjitd.sock".
std::string DefaultSocketAddress(const std::string& state_dir);

// Where clients connect by default: $OPJIT_SERVER, else the default socket.
std::string DefaultServerAddress();

}  // namespace opjit
