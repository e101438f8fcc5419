# The ragshard_python target's step: copies the package SRC over DEST, after removing from DEST
# the modules the source no longer has (a module moved to a subpackage would otherwise stay
# importable there, and a package directory beside a stale module of its name is ambiguous).
#   cmake -DSRC=python/ragshard -DDEST=build/python/ragshard -P sync_package.cmake
file(GLOB_RECURSE src_files RELATIVE ${SRC} ${SRC}/*.py)
file(GLOB_RECURSE dest_files RELATIVE ${DEST} ${DEST}/*.py)
foreach(f ${dest_files})
  list(FIND src_files ${f} i)
  if(i EQUAL -1)
    file(REMOVE ${DEST}/${f})
  endif()
endforeach()
file(COPY ${SRC}/ DESTINATION ${DEST})
