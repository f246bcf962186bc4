# Installs the configuration and systemd files; run by `cmake --install` (see
# the top-level CMakeLists.txt, which sets OPJIT_SOURCE_DIR and OPJIT_BINARY_DIR first). Runs at
# install time, so a prefix given there (`--prefix /usr`) is the one used.
#   prefix /usr:  /etc/opjit/opjitd.toml, /usr/lib/systemd/system/opjitd.service
#   other prefix: <prefix>/etc/opjit/opjitd.toml, and the unit's paths rewritten
#                 from /usr/bin and /etc to <prefix>/bin and <prefix>/etc.
#   both:         <prefix>/share/doc/opjit/{copyright,changelog.gz} (Debian's
#                 names; the changelog compressed with gzip -9n, reproducibly),
#                 <prefix>/share/lintian/overrides/opjit.
# Both honour DESTDIR.

set(_prefix "${CMAKE_INSTALL_PREFIX}")
# GNUInstallDirs' rule for SYSCONFDIR.
if(_prefix STREQUAL "/usr")
  set(_etc "/etc")
elseif(_prefix MATCHES "^/opt/")
  set(_etc "/etc${_prefix}")
else()
  set(_etc "${_prefix}/etc")
endif()
set(_src "${OPJIT_SOURCE_DIR}/deploy")

file(INSTALL DESTINATION "${_etc}/opjit" TYPE FILE FILES "${_src}/opjitd.toml")

set(_unit "${_src}/systemd/opjitd.service")
if(NOT _prefix STREQUAL "/usr")
  file(READ "${_unit}" _text)
  string(REPLACE "/usr/bin/" "${_prefix}/bin/" _text "${_text}")
  string(REPLACE "/etc/opjit/" "${_etc}/opjit/" _text "${_text}")
  set(_unit "${OPJIT_BINARY_DIR}/deploy/opjitd.service")
  file(WRITE "${_unit}" "${_text}")
endif()
file(INSTALL DESTINATION "${_prefix}/lib/systemd/system" TYPE FILE FILES "${_unit}")
file(INSTALL DESTINATION "${_prefix}/lib/sysusers.d" TYPE FILE
     FILES "${_src}/systemd/opjit.sysusers" RENAME opjit.conf)
file(INSTALL DESTINATION "${_prefix}/lib/tmpfiles.d" TYPE FILE
     FILES "${_src}/systemd/opjit.tmpfiles" RENAME opjit.conf)

# The package's documentation (lintian: copyright, changelog). opjit is its
# own upstream, so its version has no Debian revision (a "native" package) and
# the changelog is changelog.gz, not changelog.Debian.gz.
set(_doc "${OPJIT_BINARY_DIR}/deploy/doc")
file(MAKE_DIRECTORY "${_doc}")
execute_process(COMMAND gzip -9nc "${_src}/debian/changelog"
                OUTPUT_FILE "${_doc}/changelog.gz" RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "gzip of deploy/debian/changelog failed: ${_rc}")
endif()
file(INSTALL DESTINATION "${_prefix}/share/doc/opjit" TYPE FILE
     FILES "${_src}/debian/copyright" "${_doc}/changelog.gz")
file(INSTALL DESTINATION "${_prefix}/share/lintian/overrides" TYPE FILE
     FILES "${_src}/debian/lintian-overrides" RENAME opjit)
